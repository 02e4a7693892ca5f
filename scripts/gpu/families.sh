#!/usr/bin/env bash
# Every model family SGLang serves, through megarl's own path on one GPU (benchmarks/families_sglang.py), after the
# bundle's install.sh with the core, fidata and megatron chunks (../shared/device/README.md). Per family: a tiny random
# bf16 checkpoint built here, a real SGLang server started by megarl's launcher with colocated settings, the Megatron
# engine on the same checkpoint, one SFT Adam step, the weight sync into SGLang (full delivery, CUDA IPC) verified inside
# SGLang (checksums; gpt-oss: SGLang's reload), and SGLang's log-probs of greedy continuations against Megatron's on the
# same tokens, before (its own load) and after the sync. Families, in this order (FAMILIES="..." picks some):
#   llama qwen3 qwen3_moe mistral mixtral gemma3 glm4_moe gpt_oss qwen3_5 qwen3_next qwen3_5_moe deepseek_v3 qwen3_vl
# Time: the first server start on a fresh machine JIT-compiles (~110 s), later ones take ~30-50 s, so all 13 need two
# calls, e.g. FAMILIES="llama qwen3 qwen3_moe mistral mixtral gemma3" then the rest; past BUDGET seconds (default 540,
# from this script's start) the families left are skipped, and named so in the table.
# DEVICE=cpu: the CPU smoke (no GPU, no server): megarl's transformers engine in SGLang's place, and the SGLang names of
# every tensor sent. Logs, JSON ($OUT/families.json) and the server logs' tails go to $OUT; the table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-families}; mkdir -p "$OUT/server_logs"
BUDGET=${BUDGET:-540}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
if [ "$DEVICE" = cuda ]; then
  nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i $CUDA_VISIBLE_DEVICES} --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
fi
WORK=$(mktemp -d /tmp/megarl-families-XXXX)  # the checkpoints, outside $OUT (which comes back)
deadline=$(( $(date +%s) + BUDGET - SECONDS - 15 ))  # 15 s for the last server's shutdown and the table
timeout -k 15 $(( BUDGET - SECONDS + 30 )) $PY benchmarks/families_sglang.py --device "$DEVICE" --deadline "$deadline" \
  --out "$OUT/families.json" --table "$OUT/families.md" --log-dir "$OUT/server_logs" --work-dir "$WORK" \
  ${FAMILIES:+--families $FAMILIES} ${FAMILY_ARGS:-} > "$OUT/families.log" 2>&1
status=$?
for f in "$OUT"/server_logs/*.log; do [ -f "$f" ] && tail -n 60 "$f" > "$f.tail" && rm "$f"; done
rm -rf "$WORK"
grep -v '^|\|^families on' "$OUT/families.log" | tail -n 25
echo "== families.sh ($DEVICE, ${SECONDS}s): exit $status"
cat "$OUT/families.md" 2>/dev/null || echo "no table: see $OUT/families.log"
exit $status
