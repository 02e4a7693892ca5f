#!/usr/bin/env bash
# GPU check of the skeleton: the quickstart recipe with the policy on one GPU (NCCL, bf16) and the
# transformers rollout engine beside it. Run on the device machine after the bundle's install.sh;
# logs and metrics.jsonl go to $OUT (at most 8 files come back), a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"
tests_status=${PIPESTATUS[0]}
python3 -m megarl.train --config configs/quickstart.yaml trainer.device=cuda \
  actor.parallel.world_size=1 actor.parallel.tp=1 trainer.output_dir=/tmp/megarl-quickstart \
  trainer.cpus_per_rank=1 "$@" 2>&1 | tee "$OUT/quickstart.log"
status=${PIPESTATUS[0]}
echo "== GPU tests: exit $tests_status; quickstart recipe on $(cat "$OUT/gpu.txt"): exit $status"
cp "$(ls -d /tmp/megarl-quickstart/logs/*/ | tail -1)metrics.jsonl" "$OUT/quickstart_metrics.jsonl"
python3 scripts/summarize_run.py /tmp/megarl-quickstart
[ "$status" = 0 ] && [ "$tests_status" = 0 ]
