#!/usr/bin/env bash
# In-job recovery under many SIGKILLs on the CPU (scripts/chaos.py): a 60-step tiny run with a checkpoint every 5 steps
# and 6 faults (training ranks and the rollout actor, at seeded random points) against the uninterrupted run; the
# result goes to docs/results/<date>_chaos_cpu_<commit>.json. Extra arguments go to chaos.py (--steps, --faults ...).
set -euo pipefail
cd "$(dirname "$0")/.."
out="docs/results/$(date +%F)_chaos_cpu_$(git rev-parse --short HEAD).json"
.venv/bin/python scripts/chaos.py --steps 60 --save-every 5 --faults 6 --seed 0 --out "$out" "$@"
echo "result: $out"
