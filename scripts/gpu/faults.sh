#!/usr/bin/env bash
# Faults on the GPU (one GPU, ~3 min), after the bundle's install.sh (../shared/device/README.md):
#   nan   the quickstart on the GPU with an SFT learning rate that overflows (sft.lr=1e36): the run must stop
#         naming the rank and micro-batch, exit non-zero, and write no NaN into the weights (NCCL, bf16)
#   hang  the quickstart on the GPU with trainer.worker_timeout_s=40; its training rank is SIGSTOPped mid-run:
#         the run must exit non-zero within the deadline naming the rank and the call, and leave no process
#         holding GPU memory
# Logs go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-faults}; mkdir -p "$OUT"
run=(python3 -m megarl.train --config configs/quickstart.yaml trainer.device=cuda actor.parallel.world_size=1
     actor.parallel.tp=1 trainer.loggers=[console] trainer.eval_every=1000)
timeout 300 "${run[@]}" trainer.output_dir=/tmp/faults-nan sft.steps=3 sft.lr=1e36 trainer.steps=2 > "$OUT/nan.log" 2>&1
nan_rc=$?
timeout 400 "${run[@]}" trainer.output_dir=/tmp/faults-hang sft.steps=0 trainer.steps=100000 \
  trainer.worker_timeout_s=40 > "$OUT/hang.log" 2>&1 &
main=$!
for _ in $(seq 180); do grep -q "step 2" "$OUT/hang.log" 2>/dev/null && break; sleep 1; done
rank=$(pgrep -f "ray::TrainWorker" | head -1)
stopped_at=$(date +%s)
[ -n "$rank" ] && kill -STOP "$rank"
wait $main
hang_rc=$?
took=$(( $(date +%s) - stopped_at ))
sleep 5
held=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | wc -l)
echo "| fault | exit | what the run said |"
echo "| --- | --- | --- |"
echo "| NaN (sft.lr=1e36) | $nan_rc | $(grep -m1 -o "non-finite.*" "$OUT/nan.log" | cut -c1-200) |"
echo "| rank $rank SIGSTOPped | $hang_rc after ${took} s | $(grep -m1 -o "[^:]*did not answer.*" "$OUT/hang.log" | cut -c1-220) |"
echo "GPU processes left after the hung run: $held"
