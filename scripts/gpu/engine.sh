#!/usr/bin/env bash
# GPU check of the Megatron engine (issue 3): the GPU-marked tests, then benchmarks/engine_throughput.py
# (engine vs a bare megatron-core loop, ~1.4B Qwen2 shape, packed seq <= 2048, bf16) on one GPU and,
# when two are visible, at TP=2. Run on the device machine after the bundle's install.sh; JSON and logs
# go to $OUT, a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
python3 benchmarks/engine_throughput.py --out "$OUT/engine_throughput_tp1.json" 2>&1 | tee "$OUT/tp1.log" | tail -15
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  torchrun --nproc-per-node 2 benchmarks/engine_throughput.py --tp 2 --out "$OUT/engine_throughput_tp2.json" \
    2>&1 | tee "$OUT/tp2.log" | tail -15
fi
echo "== engine throughput on $(head -1 "$OUT/gpu.txt")"
for f in "$OUT"/engine_throughput_tp*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[-1], {k: v for k, v in d.items() if not isinstance(v, (dict, list))})" "$f"; done
