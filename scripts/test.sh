#!/usr/bin/env bash
# Installs the test extras into .venv and runs the suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
megarl_venv test

# System tools some tests drive for real: bubblewrap (the code sandbox), Slurm + munge (the sbatch
# script), shellcheck. As root with apt (CI and these machines) they are installed, ~20 s; elsewhere
# the tests that need them skip and say why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for tool in bwrap:bubblewrap slurmctld:slurm-wlm munged:munge shellcheck:shellcheck; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi
# Two workers, each taking a whole module as it frees (loadscope, in collection order: tests/conftest.py's): the
# suite mostly waits on subprocesses (trainers, Ray, scripts), so two overlap the waits (tests/conftest.py says what
# keeps system tests apart). A module's tests stay on one worker, so its module-scoped fixture (a Ray or Slurm
# cluster, runs several tests assert on) is built once; test by test (load) both workers built it (xdist_group marks
# do not help: xdist 3.8 renames items through an attribute pytest 9 no longer reads). The sandbox's own
# tests then run alone in this process: under an xdist worker its kill and process-count tests fail (seen with the
# other worker idle; they pass with -n 1 and without xdist).
# Exit 5 (no test selected, e.g. a -k that matches only one part) counts as a pass of that part.
# Ctrl-C ends the whole command: pytest turns it into exit 2 and the next part would start.
trap 'echo "scripts/test.sh: interrupted" >&2; exit 130' INT
parallel=0 sandbox=0
python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=25 --ignore=tests/sandbox tests "$@" \
  || parallel=$?
python -m pytest -q tests/sandbox "$@" || sandbox=$?
for rc in parallel sandbox; do [ "${!rc}" = 5 ] && printf -v "$rc" 0; done
exit $(( parallel != 0 ? parallel : sandbox ))
