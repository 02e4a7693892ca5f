#!/usr/bin/env bash
# GPU checks of issue 23 (vision-language policies) on one GPU (an H200), after the bundle's install.sh
# (../shared/device/README.md). PHASES (default "grpo"; "model" is a call of its own, ~5 min):
#   grpo   GRPO on a random Qwen2.5-VL-3B-shaped policy (benchmarks/vl_grpo.py build: 3B shapes, the offline
#          tokenizer's ~100-token vocabulary, bf16; the shapes task, images resized to 112x112) through the real
#          trainer (python -m megarl.train, configs/quickstart_vl.yaml): Megatron trains, a real SGLang server
#          (colocated, its vision tower on the triton_attn multimodal attention backend) generates from megarl's
#          processed images; every weight sync verified by checksums inside SGLang (the tower's tensors included);
#          per step the mean |SGLang log-prob - Megatron log-prob|. A random policy earns ~no reward, so an entropy
#          bonus makes every update move every weight (each sync carries new values). Before it, SGLang greedy on
#          one prompt with image A, image B, image A again (a server of its own, which also warms the JIT caches
#          the trainer's server then finds). ~5-6 min (estimated, not run yet): model build ~45 s, image check ~2 min
#          (a fresh machine's first server compiles its kernels), trainer ~2.5 min (2 steps).
#   model  benchmarks/vl_megatron.py: MegatronEngine against transformers on image+text rows (log-prob gap, forward
#          and SFT step times, peak memory) at the 3B shape.
# Logs and JSON go to $OUT; a short table is printed last; non-zero exit when a check failed.
# DEVICE=cpu: the smoke test on the tests' tiny model (hf rollout engine, no SGLang):
#   DEVICE=cpu OUT=/tmp/vl bash scripts/gpu/vl.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-vl}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
PHASES=${PHASES:-grpo}
STEPS=${STEPS:-2}
status=0
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ " $PHASES " == *" grpo "* ]]; then
  RUN=/tmp/megarl-vl-run-$$  # the model (6.8 GB at the 3B shape) stays off $OUT; logs and JSON are copied there
  rm -rf "$RUN"; mkdir -p "$RUN"
  if [ "$DEVICE" = cuda ]; then
    shape=3b engine=sglang
    devices=(trainer.device=cuda rollout.engine=sglang rollout.weight_delivery=full rollout.sglang_mem_fraction=0.3
             trainer.sync_bucket_mb=1024)
  else
    shape=tiny engine=hf devices=(trainer.device=cpu rollout.engine=hf)
  fi
  start=$SECONDS  # the three steps stay within BUDGET_S (default 470 s): the trainer gets what the first two left
  timeout 90 python3 benchmarks/vl_grpo.py build "$RUN" --shape $shape --device "$DEVICE" > "$OUT/build.log" 2>&1 \
    || { status=1; tail -n 20 "$OUT/build.log"; }
  timeout 180 python3 benchmarks/vl_grpo.py images "$RUN" --engine $engine --device "$DEVICE" > "$OUT/images.log" 2>&1 \
    || { status=1; tail -n 20 "$OUT/images.log"; }
  timeout $((${BUDGET_S:-470} - (SECONDS - start))) python3 -m megarl.train --config configs/quickstart_vl.yaml model.path="$RUN/model" \
    data.task="$RUN/shapes/train/prompts.jsonl" data.val_task="$RUN/shapes/val/prompts.jsonl" sft.steps=0 \
    sft.data="$RUN/shapes/train_blank/prompts.jsonl" \
    trainer.steps="$STEPS" trainer.eval_every=0 data.val_size=8 rollout.eval_n_samples=1 data.prompts_per_step=8 \
    rollout.n_samples=4 rollout.max_new_tokens=4 actor.optim.lr=1e-5 algorithm.entropy_coef=0.01 \
    reward.isolation=none actor.micro_batch_size=8 trainer.verify_weight_sync_every=1 trainer.cpus_per_rank=1 \
    trainer.output_dir="$RUN/train" "${devices[@]}" > "$OUT/train.log" 2>&1 || { status=1; tail -n 30 "$OUT/train.log"; }
  for log in $(find "$RUN" -name 'sglang_*.log' 2>/dev/null); do tail -n 40 "$log" > "$OUT/$(basename "$log")"; done
  cp "$RUN/train/metrics.jsonl" "$RUN"/*.json "$OUT/" 2>/dev/null
  python3 benchmarks/vl_grpo.py table "$RUN" | tee "$OUT/grpo_table.md"
  status=$((status | PIPESTATUS[0]))
  rm -rf "$RUN"
fi
if [[ " $PHASES " == *" model "* ]]; then
  shape=$([ "$DEVICE" = cuda ] && echo 3b || echo tiny)
  timeout 540 python3 benchmarks/vl_megatron.py --shape $shape --device "$DEVICE" --out "$OUT/vl.json" 2>&1 \
    | tee "$OUT/vl.log" | tail -4
  status=$((status | PIPESTATUS[0]))
fi
echo "== vl.sh [$PHASES] on $DEVICE: exit $status"
exit $status
