#!/usr/bin/env bash
# Asynchronous GRPO against synchronous on one H200, after the bundle's install.sh (../shared/device/README.md):
# benchmarks/async_grpo.py on a random Qwen2.5 shape (SIZE=0.5b or 1.5b), 128-token prompts, 512-token completions
# (ignore_eos), 8 per prompt, COMPLETIONS per step (default 256), colocated SGLang; one `python -m megarl.train` a
# run (~70 s of start-up each: Ray, Megatron, the SGLang server; the first on a fresh machine JIT-compiles ~60 s
# more), 1 warm-up + 3 measured steps + 1 (STEPS=N: N measured; an async run's margins are max_staleness + 1 each,
# below), in this order:
#   sync_resident  synchronous, both engines resident (offload never)
#   async_s1       trainer.mode=async, async.max_staleness=1, partial rollouts resumed, resident
#   async_s4       the same at async.max_staleness=4
#   async_s4_k0    async_s4 with async.batches_at_once=0: the step-batches the buffer admits together (up to 5) in
#                  one engine call
#   (an async run leaves out its first and last max_staleness + 1 steps: the buffer's first fill, made before any
#   update, and the steps after the rollout made the run's last batch, which train alone)
#   one_step_off   trainer.mode=one_step_off (async.partial=finish), resident
#   sync_offload   synchronous, with the offload cycle (trainer.offload_between_phases=always)
# Times on one H200 at 1.5B: ~70 s of start-up a run, then ~7 s a step; async_s4 runs 5 + STEPS + 5 steps (~3.5 min
# at STEPS=3, ~6 at STEPS=12), sync 1 + STEPS + 1. So about two runs a call: RUNS=sync_resident,async_s1, then
# RUNS=async_s4, then RUNS=one_step_off,sync_offload (0.5B: about half as long). Merge the calls' results:
# python -m benchmarks.async_grpo --report OUT1/async_grpo.json OUT2/...
# tokens/s/GPU and step time from the measured steps' wall clock, the trainer's own perf/tokens_per_s_per_gpu,
# staleness histograms, the sync runs' GPU busy fraction (nvidia-smi utilization.gpu every 100 ms) and overlap
# bound (T_gen + T_train) / max(T_gen, T_train). RUNS picks runs (comma-separated); a run that no longer fits the
# call's budget (BUDGET seconds, default 520) is skipped and says so: run it in a second call (RUNS=async_s4).
# MPS=1: every process under CUDA MPS (scripts/gpu/mps.sh), so the two engines' kernels can run side by side.
# OVERRIDES="k=v ...": megarl overrides for every run (e.g. async.partial=restart), TAG: a suffix to the run names.
# PLACEMENT=disaggregated: the runs with the trainer and SGLang on GPUs of their own instead
# (scripts/gpu/async_disagg.sh says which; LENGTHS, SERVER_GPUS).
# Results: $OUT/async_grpo.json (per-step phase intervals too); the timeline plot $OUT/timeline_SIZE.png where
# matplotlib imports, else run
#   python benchmarks/plot_timeline.py OUT/async_grpo.json docs/timeline.png    (on a machine that has it)
# DEVICE=cpu: the smoke run (tiny shape, the transformers engine in SGLang's place, every run; ~4-8 min on 2 cores):
#   DEVICE=cpu OUT=/tmp/async-smoke bash scripts/gpu/async.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
PLACEMENT=${PLACEMENT:-colocated}  # disaggregated: scripts/gpu/async_disagg.sh's runs (it sets this)
SIZE=${SIZE:-0.5b}
LENGTHS=${LENGTHS:-fixed}
OUT=${OUT:-/tmp/megarl-async}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
if [ "$DEVICE" = cpu ]; then
  export PYTHONPATH=$PWD
  GPUS=${GPUS:-$([ "$PLACEMENT" = disaggregated ] && echo 2 || echo 1)}
  ARGS="--smoke ${BUDGET:+--budget-s $BUDGET}"
  echo "cpu (gloo), $GPUS processes" > "$OUT/gpu.txt"
else
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
  source scripts/gpu/mps.sh  # MPS=1: under CUDA MPS (the trainer's and SGLang's kernels side by side)
  GPUS=${GPUS:-$([ "$PLACEMENT" = disaggregated ] && nvidia-smi -L | wc -l || echo 1)}
  ARGS="--budget-s ${BUDGET:-520}"
  [ "$PLACEMENT" = colocated ] && ARGS="$ARGS --model qwen2.5-$SIZE --completions ${COMPLETIONS:-256}"
  ARGS="$ARGS ${STEPS:+--steps $STEPS}"
fi
[ "$PLACEMENT" = disaggregated ] && ARGS="$ARGS --lengths $LENGTHS ${SERVER_GPUS:+--server-gpus $SERVER_GPUS}" \
  && SIZE="disagg_$LENGTHS"
# the model and run directories outside $OUT (what comes back is limited)
# shellcheck disable=SC2086  # ARGS: one argument a word
python3 -m benchmarks.async_grpo --placement "$PLACEMENT" $ARGS --gpus "$GPUS" ${RUNS:+--runs "$RUNS"} \
  --out-dir "$OUT" ${OVERRIDES:+--overrides $OVERRIDES} ${TAG:+--tag "$TAG"} \
  --work-dir "/tmp/megarl-async-work-$$"
status=$?
rm -rf "/tmp/megarl-async-work-$$"
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 benchmarks/plot_timeline.py "$OUT/async_grpo.json" "$OUT/timeline_$SIZE.png"
else
  echo "no matplotlib here: python benchmarks/plot_timeline.py OUT/async_grpo.json timeline_$SIZE.png elsewhere"
fi
echo "== async_grpo, $PLACEMENT ($SIZE) on $GPUS x $(head -1 "$OUT/gpu.txt"): exit $status"
python3 -m benchmarks.async_grpo --report "$OUT/async_grpo.json"
exit $status
