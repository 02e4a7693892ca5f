#!/usr/bin/env bash
# megarl against verl on one GPU, one model size per call (~9 min): benchmarks/e2e_vs_verl.py, verl 0.9.1's GRPO
# (FSDP + SGLang 0.5.12 colocated, its synchronous hybrid engine, its fused LM head) then megarl's (Megatron +
# SGLang 0.5.17), one after the other on the same GPU, each after a bare sglang.Engine of its own SGLang version on
# the same batch (the Engine first, in a slice of its own). Random-init Qwen2.5 shape (--model, default
# qwen2.5-0.5b), 128-token prompts, 512-token completions forced to full length, 8 per prompt, 256 per step, rule
# reward, no KL; 2 warm-up + 3 measured steps a side (--verl-warmup/--verl-steps, --megarl-...: per side). Both
# sides take more than one call together: run one per call (--runs verl --probe verl, then --runs megarl --probe
# megarl; a side in --probe alone, e.g. --runs '' --probe verl, probes its Engine without running the side: at 3B the
# two do not fit one call). A side stopped at its cap is summarised over the steps it finished; the JSON and table
# always come.
#
# Two stacks, two site directories, never one process: megarl's in /tmp/site (the bundle's core, fidata,
# megatron and ray chunks: ../shared/device/README.md), verl's in /tmp/site-verl (build_verl_chunk.sh's vsgl,
# vfidata and vpy chunks, carried as .devbundle/verl/chunks/..., plus the bundle's ray parts, which install.sh
# left in /tmp/bundle_parts/ray). A call may carry any subset of verl's parts: they are kept in /tmp/verl_parts
# and a chunk is unpacked once all its parts have come (install.sh's rule), so the chunks can be spread over
# the install calls that the 64 MiB per call limit needs (docs/benchmarks.md, "Side by side with verl"):
#   bash scripts/gpu/e2e_vs_verl.sh install          # only install what this call carried, then stop
#   bash scripts/gpu/e2e_vs_verl.sh [ARGS...]         # install what it carried, then run (ARGS go to the benchmark,
#                                                     # e.g. --model qwen2.5-1.5b, --runs verl, --megarl-old-logprobs always)
# $OUT gets e2e_vs_verl.json (raw results: commit, GPU, versions of both stacks, unmatched settings), verl's
# resolved config (verl_config.yaml) and overrides, both sides' logs and metrics, the Engine probes' logs; the
# model stays out of $OUT. A short table is last. DEVICE=cpu: the CPU smoke (megarl only; verl's config written).
# PACK=1: all of $OUT but the JSON and the log go into $OUT/files.tgz (the lent GPU machine returns 8 files at most).
# --model qwen2.5-3b: add --offload auto (megarl's default offload cycle; the benchmark's never does not fit the 3B
# update beside SGLang's share on one H200: docs/benchmarks.md) and --megarl-warmup 1 --verl-warmup 1 --verl-steps 3.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/megarl-e2e-verl}; mkdir -p "$OUT"
WORK=/tmp/megarl-e2e-verl-work; rm -rf "$WORK"
if [ "${DEVICE:-cuda}" = cpu ]; then
  timeout 900 python3 -m benchmarks.e2e_vs_verl --smoke --out-dir "$OUT" --work-dir "$WORK" "$@"; exit $?
fi

VSITE=/tmp/site-verl VPARTS=/tmp/verl_parts
mkdir -p "$VPARTS/ray"
cp -n /tmp/bundle_parts/ray/* "$VPARTS/ray/" 2>/dev/null || true   # the bundle's ray, from megarl's install
[ -d .devbundle/verl/chunks ] || mkdir -p .devbundle/verl/chunks
BUNDLE=.devbundle/verl SITE="$VSITE" PARTS="$VPARTS" bash .devbundle/bin/install.sh 2>&1 | sed 's/^/[verl] /'
[ "${1:-}" = install ] && exit 0

# verl's stack is needed only when verl runs or its Engine is probed (the driver itself runs in megarl's)
sides="verl,megarl verl,megarl" args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --runs) sides="${args[$((i + 1))]:-} ${sides#* }" ;;
    --probe) sides="${sides%% *} ${args[$((i + 1))]:-}" ;;
    --runs=*) sides="${args[$i]#--runs=} ${sides#* }" ;;
    --probe=*) sides="${sides%% *} ${args[$i]#--probe=}" ;;
  esac
done
missing=""
for c in core fidata megatron ray; do [ -f "/tmp/site/.installed-$c" ] || missing="$missing /tmp/site:$c"; done
if [[ "$sides" == *verl,* || "$sides" == *verl || "$sides" == *verl\ * ]]; then
  for c in vsgl vfidata vpy ray; do [ -f "$VSITE/.installed-$c" ] || missing="$missing $VSITE:$c"; done
fi
if [ -n "$missing" ]; then
  echo "e2e_vs_verl.sh: not installed:$missing (see the header: install calls first)"; exit 2; fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
export PYTHONPATH=/tmp/site:$PWD  # the driver: megarl's stack; verl's processes get --verl-site instead
# the whole call within 560 s: the benchmark keeps to what is left of 530 s after the install (stopping its
# processes included); timeout is the backstop (on its SIGTERM the JSON and the table are still written)
BUDGET=$((530 - SECONDS))
timeout -k 10 $((BUDGET + 15)) python3 -m benchmarks.e2e_vs_verl --out-dir "$OUT" --work-dir "$WORK" --budget-s $BUDGET \
  --verl-site "$VSITE" --megarl-site /tmp/site "$@" > "$OUT/e2e_vs_verl.log" 2>&1
status=$?
grep -v '^|' "$OUT/e2e_vs_verl.log" | tail -n 50
echo "== e2e_vs_verl.sh on $(cut -d, -f1 "$OUT/gpu.txt"): exit $status"
grep '^|' "$OUT/e2e_vs_verl.log" || echo "(no table: see $OUT/e2e_vs_verl.log)"
if [ "${PACK:-0}" = 1 ]; then  # the lent GPU machine returns at most 8 files from $OUT: the rest in one archive
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name e2e_vs_verl.json ! -name e2e_vs_verl.log ! -name files.tgz \
     -printf '%P\n' | tar -czf files.tgz -T - --remove-files) && echo "(the other files: $OUT/files.tgz)"
fi
exit $status
