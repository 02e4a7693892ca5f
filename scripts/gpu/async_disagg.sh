#!/usr/bin/env bash
# Asynchronous GRPO with the trainer and SGLang on GPUs of their own (nvidia-h200-x2 or more), after the bundle's
# install.sh (../shared/device/README.md); also multi_gpu.sh's `async` phase. benchmarks/async_grpo.py
# --placement disaggregated: a random Qwen2.5-1.5B, 128-token prompts, 8 samples per prompt, 64 prompts per step,
# LENGTHS=fixed (every completion 1024 tokens) or tail (natural lengths to 4096, ~10% at the cap); runs (RUNS,
# comma-separated; default all five):
#   colocated_sync        synchronous on all GPUS, a colocated SGLang server on each, the offload cycle
#   disagg_sync           the trainer on GPUS - SERVER_GPUS GPUs (GPU 0, or 0-1), SGLang servers on SERVER_GPUS of their
#                         own (default half), weights broadcast over NCCL
#   disagg_one_step_off   the same placement, trainer.mode=one_step_off
#   disagg_async_s1/_s4   the same placement, trainer.mode=async, async.max_staleness 1 / 4, partial rollouts resumed
# tokens/s/GPU (over every GPU of the run), step time, staleness histogram, each speed-up against disagg_sync beside
# the bound (T_gen + T_train) / max(T_gen, T_train) of that run; $OUT/async_grpo.json holds the phase intervals for
#   python benchmarks/plot_timeline.py OUT/async_grpo.json timeline_disagg.png  (drawn here if matplotlib imports)
# Measured on 1+1 H200s (docs/benchmarks.md, "Asynchronous training"): the fixed workload's step takes
# 23.3 s disaggregated synchronous (generate 11.2 s, train 11.9 s), 12.4 s one_step_off, 12.0 / 12.7 s async s1 / s4,
# 15.5 s colocated on both GPUs; the long tail's 49.4 s synchronous, 28.1 s one_step_off (STEPS=2). A run's start-up
# is ~70 s, and the first SGLang start on a fresh machine JIT-compiles for ~110 s more: a call of <= 9 min holds two
# runs a lane, so on 4 GPUs the fixed workload's five runs and the tail's four take four calls with LANES (below);
# merge the calls' tables with python -m benchmarks.async_grpo --report OUT1/async_grpo.json OUT2/async_grpo.json ...
# On 4 GPUs `PHASES=async RUNS=... bash scripts/gpu/multi_gpu.sh` runs both LENGTHS at once, each on 2 GPUs (its own
# CUDA_VISIBLE_DEVICES), or any lanes of LANES="lengths:runs ...": e.g. the fixed workload's runs two GPU pairs at a
# time, LANES="fixed:disagg_sync fixed:disagg_one_step_off", then "fixed:disagg_async_s1 fixed:disagg_async_s4".
# A run that no longer fits BUDGET (seconds, default 520) is skipped and says so. scripts/gpu/async.sh (the one-GPU
# runs' script) does the work, with PLACEMENT=disaggregated.
# DEVICE=cpu: the smoke run through gloo, the transformers engine in SGLang's place (its own Ray actor), tiny shapes,
# GPUS processes (default 2) — every run (~10 min on 2 cores; colocated_sync and disagg_async_s1 took 5 min under
# heavy contention):
#   DEVICE=cpu OUT=/tmp/async-disagg-smoke bash scripts/gpu/async_disagg.sh
PLACEMENT=disaggregated OUT=${OUT:-/tmp/megarl-async-disagg} exec bash "$(dirname "$0")/async.sh"
