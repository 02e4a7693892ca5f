#!/usr/bin/env bash
# GPU benchmark of megarl.engine.logprobs.vocab_parallel_logprobs (one GPU), after the bundle's install.sh
# (needs megatron-core in /tmp/site); JSON and logs go to $OUT, a short table is printed last. PHASES
# (default "bench"):
#   bench  - benchmarks/logprobs_speed.py: forward + backward of the plain log_softmax formula vs the chunked
#            function on [10240, 151936] bf16 logits: time, peak memory, compile (warm-up) time and
#            their agreement                                                                  (~2 min)
#   tests  - tests/engine/test_megatron_gpu.py: the bf16 engine (which uses the function) vs transformers
#                                                                                              (~1.5 min)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/megarl-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
PHASES=${PHASES:-bench}
phase() { [[ " $PHASES " == *" $1 "* ]]; }
status=0
if phase tests; then
  timeout 240 python3 -m pytest -q -m gpu tests/engine/test_megatron_gpu.py > "$OUT/gpu_tests.log" 2>&1 || status=1
  echo "== GPU tests: $(tail -1 "$OUT/gpu_tests.log")"
fi
if phase bench; then
  timeout 300 python3 benchmarks/logprobs_speed.py --out "$OUT/logprobs_speed.json" > "$OUT/logprobs_speed.log" 2>&1 \
    || { status=1; echo "logprobs_speed.py failed (see logprobs_speed.log):"; tail -15 "$OUT/logprobs_speed.log"; }
  echo "== log-probs forward + backward on $(head -1 "$OUT/gpu.txt")"
  grep '^|' "$OUT/logprobs_speed.log"
fi
exit $status
