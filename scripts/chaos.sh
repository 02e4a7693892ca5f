#!/usr/bin/env bash
# In-job recovery under many faults on the CPU (scripts/chaos.py): 4 rounds of a 60-step tiny run with a checkpoint every
# 5 steps, each with 8 SIGKILLs and SIGSTOPs of training ranks and the rollout actor at seeded random points, against
# the uninterrupted run; the table goes to docs/results/<date>_chaos_cpu_<commit>.md. Extra arguments go to chaos.py
# (--steps, --rounds, --faults ...).
set -euo pipefail
cd "$(dirname "$0")/.."
out="docs/results/$(date +%F)_chaos_cpu_$(git rev-parse --short HEAD).md"
.venv/bin/python scripts/chaos.py --steps 60 --save-every 5 --rounds 4 --faults 8 --seed 0 --out "$out" "$@"
echo "result: $out"
