#!/usr/bin/env bash
# Weight sync into SGLang and rollout throughput (benchmarks/weight_sync.py), after the bundle's
# install.sh (../shared/device/README.md). One call each, within BUDGET seconds (default 530) of parts:
#   1 GPU  (default PARTS="sync_7b sync_1.5b sync_0.5b throughput"): ~9 min expected: over BUDGET, the last part is skipped.
#   2 GPUs (default PARTS="sync_tp2 nccl"):                           ~4.5 min expected, 9 at most.
# Parts, in PARTS order, each its own process with its own time limit (capped by what is left of BUDGET;
# a part with under 45 s left is skipped): one failing or timing out keeps everything measured before it.
#   sync_7b    colocated CUDA IPC into a TP=1 server, random Qwen2.5-7B shape (dummy load), the number that
#              matters: formats persistent / tensors x buckets 2048 / 4096 / 8192 MiB x SGLang's weights
#              released during training or resident                                                 (~100 s)
#   sync_1.5b  the same at 1.5B, 1024 MiB buckets                                                  (~65 s)
#   sync_0.5b  the same at 0.5B, each format verified bit for bit inside SGLang (weights checker)   (~70 s)
#   throughput sglang.Engine and megarl's SGLangRolloutEngine.generate (one request, requests of 64 rows, and
#              on a server with the memory saver), all on the GPU at once, measured in turns (medians of 7
#              rounds, also on SGLang's own clock, each batch from an empty prefix cache); one request timed
#              step by step against SGLang's own latency; 0.5B; decode CUDA graphs as megarl sizes them for
#              the batch (512 rows), so the first of its 3 starts JIT-compiles                    (~300 s)
#   sync_tp2   (2 GPUs) one TP=2 server on GPUs 0-1, 7B, trainer on GPU 0, as sync_7b but 4096 / 8192 / 16384 MiB
#              buckets (a post costs ~15 ms at TP=2 beyond SGLang's load, ~4 at TP=1: fewer posts) (flattened_bucket,
#              SGLang's own loader, crashed a TP=2 server in sglang 0.5.17)                           (~110 s)
#   sync_tp2_small (2 GPUs) the same at 0.5B and 1.5B, 1024 MiB buckets, verified as sync_0.5b          (~150 s)
#   nccl       (2 GPUs) disaggregated: server on GPU 1, NCCL broadcast from GPU 0, 1.5B, flattened and
#              per-tensor, each verified bit for bit (a 3 GB safetensors export each)                (~120 s)
# Sync-only servers run without CUDA graphs or the warm-up request (nothing to JIT at start-up; the weight
# update path is the training one). JSON is written after every measurement, logs and server-log tails go
# to $OUT, and a short table is printed last. DRY=1 checks the plumbing on a CPU (no GPU, no server).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 NCCL_CUMEM_ENABLE=0
OUT=${OUT:-/tmp/megarl-weight-sync}; mkdir -p "$OUT/server_logs"
PY=${PY:-python3}
BUDGET=${BUDGET:-530}
if [ -n "${DRY:-}" ]; then
  GPUS=${GPUS:-1}; DRYARG=--dry-run; echo "dry run (no GPU)" > "$OUT/gpu.txt"
else
  DRYARG=""
  SMI_GPUS=${CUDA_VISIBLE_DEVICES:+-i $CUDA_VISIBLE_DEVICES}  # the GPUs this run may use
  nvidia-smi $SMI_GPUS --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
  GPUS=$(nvidia-smi $SMI_GPUS --query-gpu=index --format=csv,noheader | wc -l)
fi
if [ "$GPUS" -ge 2 ]; then PARTS=${PARTS:-sync_tp2 nccl}; else PARTS=${PARTS:-sync_7b sync_1.5b sync_0.5b throughput}; fi
B="$PY benchmarks/weight_sync.py"
part_command() {  # name -> "limit_seconds command..."
  local common="--log-dir $OUT/server_logs --out $OUT/$1.json $DRYARG"
  case $1 in
    sync_7b)    echo "200 $B sync --models qwen2.5-7b --formats persistent tensors --bucket-mb 2048 4096 8192 --weights released resident --trials 3 $common" ;;
    sync_1.5b)  echo "120 $B sync --models qwen2.5-1.5b --trials 3 $common" ;;
    sync_0.5b)  echo "130 $B sync --models qwen2.5-0.5b --trials 3 --verify $common" ;;
    throughput) echo "520 $B throughput --models qwen2.5-0.5b $common" ;;
    sync_tp2)   echo "220 $B sync --models qwen2.5-7b --server-tp 2 --formats persistent tensors --bucket-mb 4096 8192 16384 --weights released resident --trials 3 $common" ;;
    sync_tp2_small) echo "240 $B sync --models qwen2.5-0.5b qwen2.5-1.5b --server-tp 2 --formats persistent tensors --weights released resident --trials 3 --verify $common" ;;
    nccl)       echo "200 $B nccl --models qwen2.5-1.5b --verify $common" ;;
    *)          echo "" ;;
  esac
}
for name in $PARTS; do
  spec=$(part_command "$name")
  if [ -z "$spec" ]; then echo "== $name: unknown part (known: sync_7b sync_1.5b sync_0.5b throughput sync_tp2 sync_tp2_small nccl)"; continue; fi
  if [[ "$name" == sync_tp2* || "$name" == nccl ]] && [ "$GPUS" -lt 2 ]; then echo "== $name: needs 2 GPUs, skipped"; continue; fi
  limit=${spec%% *}; left=$(( BUDGET - SECONDS ))
  (( limit > left )) && limit=$left
  if (( limit < 45 )); then echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left"; continue; fi
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout -k 15 "$limit" ${spec#* } > "$OUT/$name.log" 2>&1
  echo "   exit $? at ${SECONDS}s"; tail -n 3 "$OUT/$name.log"
done
# keep only the server logs' tails (the files that come back are limited)
for f in "$OUT"/server_logs/*.log; do [ -f "$f" ] && tail -n 60 "$f" > "$f.tail" && rm "$f"; done
echo "== weight sync on $(head -1 "$OUT/gpu.txt") ($GPUS GPU(s)), ${SECONDS}s; goal >= 100 GB/s effective"
$B table --out-dir "$OUT" --parts $PARTS
