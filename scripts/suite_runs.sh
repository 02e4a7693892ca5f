#!/usr/bin/env bash
# Clean-clone suite runs under a CPU hog, one after another, each recorded as one JSON line in
# docs/results/suite_runs.jsonl (commit, host, cores, hog, result, minutes, failed tests): the record that the
# suite holds on a loaded machine. Usage: bash scripts/suite_runs.sh [RUNS] (default 1); HOG=N busy processes
# beside the suite (default 1: one of a 2-core CI machine's cores); REF=commit to test (default HEAD).
# Stops at the first red run and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD runs=${1:-1} hog=${HOG:-1} ref=${REF:-HEAD}
record=$repo/docs/results/suite_runs.jsonl
commit=$(git rev-parse --short "$ref")
for run in $(seq "$runs"); do
  work=$(mktemp -d /tmp/megarl-suite-XXXXXX)
  git clone -q "$repo" "$work/megarl" && git -C "$work/megarl" checkout -q "$commit"
  hogs=()
  for _ in $(seq "$hog"); do python3 -c 'while True: pass' & hogs+=($!); done
  start=$(date +%s) rc=0
  (cd "$work/megarl" && bash .ci/run) >"$work/log" 2>&1 || rc=$?
  minutes=$(( ($(date +%s) - start + 30) / 60 ))
  [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null || true
  failed=$(grep -E '^(FAILED|ERROR) ' "$work/log" | cut -d' ' -f2 | sort -u | python3 -c \
    'import json, sys; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))')
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$work/log" | tail -2 | tr '\n' ';' | tr -d '=')
  python3 - "$record" <<PY
import json, sys
row = {"date": "$(date -u +%F)", "commit": "$commit", "host": "$(hostname)", "cores": $(nproc), "hog": $hog,
       "passed": $rc == 0, "exit": $rc, "minutes": $minutes, "failed": $failed, "summary": "$summary".strip("; ")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(row) + "\n")
print(json.dumps(row))
PY
  if [ "$rc" != 0 ]; then
    echo "run $run of $runs failed: log kept at $work/log" >&2
    exit "$rc"
  fi
  rm -rf "$work"
done
