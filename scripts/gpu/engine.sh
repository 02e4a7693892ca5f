#!/usr/bin/env bash
# GPU check of the Megatron engine, after the bundle's install.sh; JSON and logs go to $OUT, a short
# table is printed last. PHASES (default "tests tp1 tp1sdpa tp2 tp2sp cp2"; tp2, tp2sp and cp2 need two GPUs):
#   tests  - tests/engine/test_megatron_gpu.py: bf16 engine vs transformers; varlen flash attention vs masked
#            SDPA on packed rows (log-probs, one SFT step)                                            (~1.5 min)
#   tp1    - benchmarks/engine_throughput.py (engine vs a bare megatron-core loop, ~1.4B Qwen2 shape, packed
#            seq <= 2048, bf16) with attention=auto (varlen flash for packed rows)                   (~2 min)
#   tp1sdpa - the engine alone with attention=sdpa (masked SDPA: the previous kernel), for comparison (~1 min)
#   tp2    - engine vs bare loop at TP=2 on two GPUs                                                  (~2 min)
#   tp2sp  - TP=2 with sequence parallelism: engine and bare loop, and the engine's log-probs checked against
#            an engine without SP holding the same weights (sp_check)                                 (~2 min)
#   cp2    - context parallelism (K/V all-gathered, masked SDPA) on two GPUs: the engine at CP=2 and, on the
#            same two GPUs and kernel, at DP=2 (CP=1); CP=2's log-probs checked against a CP=1 engine holding
#            the same weights (cp_check). Sequences up to CP_SEQ (default 2048) tokens              (~3 min)
#   packing - the bare loop, then the engine with actor.packing=rows and with one_row (one row of
#            8192 tokens per micro-batch, cut to its used length; the LM head at real positions only), on
#            the same batch: token slots, padding share and MFU of each (the goal: one_row >= 38% MFU) (~4 min)
#   packing_defaults - packing at the defaults (no token budget; micro_batch_size 4): the bare loop and the
#            engine on padded rows of 4, then one_row's automatic width (4 x the longest, 8192): one_row's MFU
#            as in `packing`, its peak memory no higher than padded rows'                             (~4 min)
#   fused  - the engine with actor.fused_kernels on and off ("engine", "engine_unfused": SwiGLU and RoPE
#            as Triton kernels, or megatron's unfused ops) beside the bare loop, at the e2e update's batch at 64
#            completions (0.5B shape, 64 x 640 tokens, 4 micro-batches of 16) and at the 1.4B default    (~4 min)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
PHASES=${PHASES:-tests tp1 tp1sdpa tp2 tp2sp cp2}
CP_SEQ=${CP_SEQ:-2048}
GPUS=$(nvidia-smi -L | wc -l)
BENCH=benchmarks/engine_throughput.py
ATTN=${ATTN:-auto}
phase() { [[ " $PHASES " == *" $1 "* ]]; }
if phase tests; then
  timeout 240 python3 -m pytest -q -m gpu tests/engine/test_megatron_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "== GPU tests: $(tail -1 "$OUT/gpu_tests.log")"
fi
if phase tp1; then
  timeout 240 python3 $BENCH --attention $ATTN --out "$OUT/engine_throughput_tp1.json" > "$OUT/tp1.log" 2>&1
  tail -4 "$OUT/tp1.log"
  if [ ! -s "$OUT/engine_throughput_tp1.json" ]; then
    echo "the TP=1 run with attention=$ATTN failed (see tp1.log): the TP=2 runs use attention=sdpa"; ATTN=sdpa
  fi
fi
if phase tp1sdpa; then
  timeout 150 python3 $BENCH --attention sdpa --skip-bare --out "$OUT/engine_throughput_tp1_masked_sdpa.json" \
    > "$OUT/tp1_masked_sdpa.log" 2>&1; tail -2 "$OUT/tp1_masked_sdpa.log"
fi
if phase packing; then
  timeout 300 python3 $BENCH --attention $ATTN --packing both --out "$OUT/engine_throughput_packing.json" \
    > "$OUT/packing.log" 2>&1; tail -5 "$OUT/packing.log"
fi
if phase packing_defaults; then
  timeout 300 python3 $BENCH --attention $ATTN --packing both --max-tokens 0 --micro-batch-size 4 \
    --out "$OUT/engine_throughput_packing_defaults.json" > "$OUT/packing_defaults.log" 2>&1
  tail -5 "$OUT/packing_defaults.log"
fi
if phase fused; then
  timeout 200 python3 $BENCH --attention $ATTN --size 0.5b --seq 640 --min-len 640 --sequences 64 --max-tokens 10240 \
    --micro-batch-size 16 --packing one_row --fused-kernels both --out "$OUT/engine_throughput_fused_0.5b_64x640.json" \
    > "$OUT/fused_0.5b.log" 2>&1; tail -4 "$OUT/fused_0.5b.log"
  timeout 300 python3 $BENCH --attention $ATTN --packing one_row --fused-kernels both \
    --out "$OUT/engine_throughput_fused_1.4b.json" > "$OUT/fused_1.4b.log" 2>&1; tail -4 "$OUT/fused_1.4b.log"
fi
if [ "$GPUS" -ge 2 ] && phase tp2; then
  timeout 200 torchrun --nproc-per-node 2 $BENCH --tp 2 --attention $ATTN --out "$OUT/engine_throughput_tp2.json" \
    > "$OUT/tp2.log" 2>&1; tail -4 "$OUT/tp2.log"
fi
if [ "$GPUS" -ge 2 ] && phase tp2sp; then
  timeout 200 torchrun --nproc-per-node 2 $BENCH --tp 2 --attention $ATTN --sequence-parallel \
    --out "$OUT/engine_throughput_tp2_sp.json" > "$OUT/tp2_sp.log" 2>&1; tail -5 "$OUT/tp2_sp.log"
fi
if [ "$GPUS" -ge 2 ] && phase cp2; then
  timeout 200 torchrun --nproc-per-node 2 $BENCH --attention sdpa --skip-bare --seq "$CP_SEQ" \
    --out "$OUT/engine_throughput_dp2_sdpa.json" > "$OUT/dp2_sdpa.log" 2>&1; tail -2 "$OUT/dp2_sdpa.log"
  timeout 240 torchrun --nproc-per-node 2 $BENCH --cp 2 --attention sdpa --seq "$CP_SEQ" \
    --out "$OUT/engine_throughput_cp2.json" > "$OUT/cp2.log" 2>&1; tail -3 "$OUT/cp2.log"
fi
[ -s "$OUT/gpu_tests.log" ] && echo "== GPU tests: $(tail -1 "$OUT/gpu_tests.log")"
echo "== engine throughput on $GPUS x $(head -1 "$OUT/gpu.txt") (goals: engine/bare >= 90%, MFU >= 40%)"
python3 - "$OUT"/engine_throughput_*.json <<'PY'
import json, sys
print("| run | attention | SP | CP | bare ms | bare MFU | engine ms | engine tok/s/GPU | engine MFU | engine GiB "
      "| engine/bare | SP/CP log-prob check |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"| {path.rsplit('/', 1)[-1]} | unreadable: {e} |")
        continue
    b, e, unfused = d.get("bare", {}), d.get("engine", {}), d.get("engine_unfused")
    ms = lambda r: f"{1e3 * r['mean_step_seconds']:.0f}" if r else "-"
    pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"
    sp = d.get("sp_check") or d.get("cp_check")
    check = f"max {sp['max_abs_diff']:.3g} mean {sp['mean_abs_diff']:.3g} ok={sp['ok']}" if sp else "-"
    gib = f"{e['peak_memory_gib']:.1f}" if "peak_memory_gib" in e else "-"
    print(f"| {path.rsplit('/', 1)[-1][len('engine_throughput_'):-5]} | {d.get('attention')} | {d.get('sequence_parallel')} "
          f"| {d.get('layout', {}).get('cp', 1)} | {ms(b)} | {pct(b.get('mfu'))} | {ms(e)} "
          f"| {e.get('tokens_per_s_per_gpu', 0):,.0f} | {pct(e.get('mfu'))} | {gib} "
          f"| {pct(d.get('engine_over_bare'))} | {check} |")
    if unfused:
        print(f"| ... unfused | | | | | | {ms(unfused)} | {unfused.get('tokens_per_s_per_gpu', 0):,.0f} "
              f"| {pct(unfused.get('mfu'))} | | {pct(d.get('engine_unfused_over_bare'))} | |")
PY
