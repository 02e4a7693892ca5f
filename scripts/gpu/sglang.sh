#!/usr/bin/env bash
# GPU run of issue 4 on one GPU (one H200: ~7 min), after the bundle's install.sh (../shared/device/README.md):
#   grpo  - GRPO end to end, colocated: the policy in megatron-core, rollouts from a real SGLang server
#           on the same GPU (KV cache released between rollouts), weights pushed by CUDA IPC after each
#           step and verified inside SGLang (weights checker: received vs its own loader's reading of the
#           exported file); a 0.28B random-init Qwen2-shape model (char tokenizer) after a short SFT;
#           the mean |SGLang log-prob - Megatron log-prob| on the same tokens, per step.
#   sync  - benchmarks/weight_sync.py: sync time split and GB/s for 0.5B / 1.5B / 7B dummy models, TP=1.
# PHASES="grpo sync" by default; logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-sglang}; mkdir -p "$OUT"
PHASES=${PHASES:-grpo sync}
RUN=/tmp/megarl-sglang-run
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
if [[ " $PHASES " == *" grpo "* ]]; then
  rm -rf "$RUN"
  timeout 420 python3 -m megarl.train --config configs/quickstart.yaml trainer.device=cuda \
    actor.parallel.world_size=1 actor.parallel.tp=1 rollout.engine=sglang rollout.sglang_mem_fraction=0.35 \
    model.tiny_hidden_size=896 model.tiny_num_layers=24 model.tiny_num_heads=14 model.tiny_num_kv_heads=2 \
    actor.optim.lr=2e-5 sft.lr=2e-4 sft.steps=40 trainer.steps=6 trainer.eval_every=3 \
    actor.micro_batch_size=32 trainer.cpus_per_rank=1 trainer.output_dir=$RUN "$@" > "$OUT/grpo.log" 2>&1
  status=$?
  tail -n 25 "$OUT/grpo.log"
  cp "$RUN/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
  ls "$RUN"/sglang_*.log >/dev/null 2>&1 && tail -n 40 "$RUN"/sglang_*.log > "$OUT/grpo_sglang_server.log"
  python3 - "$OUT/grpo_metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if len(sys.argv) > 1 else []
print("| step | train/reward | val/reward | rollout/logprob_abs_diff | timing/sync s | timing/generate s |")
print("| --- | --- | --- | --- | --- | --- |")
for r in rows:
    if "train/reward" in r or "val/reward" in r:
        f = lambda k: f"{r[k]:.4g}" if k in r else ""
        print(f"| {r.get('step', '')} | {f('train/reward')} | {f('val/reward')} | {f('rollout/logprob_abs_diff')} "
              f"| {f('timing/sync')} | {f('timing/generate')} |")
PY
fi
if [[ " $PHASES " == *" sync "* ]]; then
  # MEGARL_COMMIT: the device copy has no .git; pass the commit in to stamp the JSON
  timeout 400 python3 benchmarks/weight_sync.py sync --models qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b \
    --out "$OUT/weight_sync.json" --log-dir "$OUT" ${SYNC_ARGS:-} 2>&1 | tail -n 30 | tee "$OUT/weight_sync.log"
  status=$(( status | PIPESTATUS[0] ))
fi
echo "== sglang.sh phases [$PHASES] on $(cat "$OUT/gpu.txt"): exit $status"
exit $status
