#!/usr/bin/env bash
# megarl against TRL on one GPU (one H200: ~8 min, 9 at most): benchmarks/e2e_vs_trl.py, end-to-end GRPO speed
# side by side, one after the other on the same GPU: TRL's GRPOTrainer (HF generate, bf16; 1 warm-up + 2
# measured steps of 64 completions), then megarl GRPO (Megatron + SGLang colocated; 2 warm-up + 4 measured
# steps) at 64 and at 256 completions per step. Random-init Qwen2.5-0.5B shape with an offline 151,936-token
# BPE, 128-token prompts, 512-token completions forced to full length, 8 per prompt, rule reward, no reference.
#
# Needs in /tmp/site: the bundle's core, fidata, megatron and ray chunks (../shared/device/README.md, two
# install calls) and this repo's trl chunk (scripts/gpu/build_trl_chunk.sh), e.g. in the same call:
#   bash .devbundle/bin/install.sh && bash scripts/gpu/e2e_vs_trl.sh     (carry .devbundle/bin, .devbundle/chunks/trl)
# Each side runs in its own process under a deadline; a side that fails or runs out of time keeps the steps
# it finished. $OUT gets e2e_vs_trl.json (raw results: commit, GPU, versions), e2e_vs_trl.png (if matplotlib
# is there), each side's log and megarl's metrics.jsonl; the model stays out of $OUT. A short table is last.
# Extra arguments go to the benchmark (e.g. --runs megarl, --model qwen2.5-1.5b).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/megarl-e2e}; mkdir -p "$OUT"
WORK=/tmp/megarl-e2e-work; rm -rf "$WORK"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
ls /tmp/site/.installed-* 2>/dev/null | sed 's|.*/.installed-|installed chunk: |' | tr '\n' ' '; echo
timeout 515 python3 -m benchmarks.e2e_vs_trl --out-dir "$OUT" --work-dir "$WORK" --budget-s 490 "$@" \
  > "$OUT/e2e_vs_trl.log" 2>&1
status=$?
grep -v '^|' "$OUT/e2e_vs_trl.log" | tail -n 60
# the plot (matplotlib is in the GPU image; benchmarks/plot_e2e.py also runs anywhere else on the JSON)
timeout 20 python3 benchmarks/plot_e2e.py "$OUT/e2e_vs_trl.png" "$OUT/e2e_vs_trl.json" > "$OUT/plot.log" 2>&1 \
  || echo "(no plot: $(tail -n 1 "$OUT/plot.log"))"
echo "== e2e_vs_trl.sh on $(cut -d, -f1 "$OUT/gpu.txt"): exit $status"
grep '^|' "$OUT/e2e_vs_trl.log" || echo "(no table: see $OUT/e2e_vs_trl.log)"
exit $status
