#!/usr/bin/env bash
# GPU check of issue 23's model side on one GPU (an H200: the 3B shape trains with Adam in ~70 GB; ~5 min), after the
# bundle's install.sh (../shared/device/README.md): a random Qwen2.5-VL-3B-shaped model (transformers builds and
# saves it) on image+text rows, MegatronEngine (bf16, packed micro-batches, varlen attention) against transformers:
# log-prob gap, forward and SFT train-step times, peak memory (benchmarks/vl_megatron.py). JSON to $OUT, a one-row
# table printed last. DEVICE=cpu: the smoke test on the tests' tiny model:  DEVICE=cpu OUT=/tmp/vl bash scripts/gpu/vl.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/megarl-vl}; mkdir -p "$OUT"
if [ "${DEVICE:-cuda}" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  timeout 540 python benchmarks/vl_megatron.py --shape 3b --device cuda --out "$OUT/vl.json" 2>&1 | tee "$OUT/vl.log" | tail -4
else
  timeout 900 python benchmarks/vl_megatron.py --shape tiny --device cpu --out "$OUT/vl.json" 2>&1 | tee "$OUT/vl.log" | tail -4
fi
