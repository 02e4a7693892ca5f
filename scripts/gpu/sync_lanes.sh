#!/usr/bin/env bash
# SGLang rollouts and weight sync on several GPUs in one call, after the bundle's install.sh
# (../shared/device/README.md): steps of scripts/gpu/sglang.sh and scripts/gpu/weight_sync.sh in lanes that run in
# parallel, each step on GPUs of its own. Every step gets what is left of BUDGET seconds (default 560); its output goes
# to $OUT/<step>/, all of $OUT but weight files is packed into $OUT/all.tgz (few files come back from a call), and each
# step's exit code and the tail of its output are printed last.
#   LANES: lanes separated by ";", each a sequence of "GPUS=STEP" (run STEP with CUDA_VISIBLE_DEVICES=GPUS)
#   and "wait:STEP" (until that step of another lane has ended). A STEP:
#     grpo              GRPO colocated on one GPU, SGLang verified after every sync            (~3.5 min)
#     grpo_tp2          the same at TP=2 on two GPUs                                           (~4-5 min)
#     grpo_tp2_sharded  grpo_tp2 with rollout.weight_delivery=sharded: each rank posts its shard (~5 min)
#     grpo_disagg       two GPUs: trainer and SGLang apart, weights by NCCL                    (~3.5 min)
#     reshard_tp2       two GPUs: benchmarks/multi_gpu.py reshard, a 7B Qwen2.5 shape at TP=2 into a colocated
#                       TP=2 server, full then sharded delivery, 8 GiB buckets, verified then timed; SGLang at
#                       --mem-fraction 0.6 (its KV cache: what is left after the trainer's ~40 GB)  (~5-7 min)
#     any part of weight_sync.sh (sync_7b, sync_tp2, sync_tp2_small, sync_0.5b, throughput, nccl)
#   The default (3 GPUs, ~7 min) runs the 7B full-vs-sharded reshard beside the rollout throughput part. Other
#   lanes: "0,1=grpo_tp2 0,1=sync_tp2; 2,3=grpo_tp2_sharded 2,3=sync_tp2_small", "0,1=grpo_tp2; 2,3=reshard_tp2";
#   the rollout throughput alone on a GPU: "0=throughput" (docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/megarl-sync-lanes}; mkdir -p "$OUT"
BUDGET=${BUDGET:-560}
LANES=${LANES:-"0,1=reshard_tp2; 2=throughput"}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"

step() {  # step NAME GPUS
  local name=$1 gpus=$2 dir="$OUT/$1" left=$(( BUDGET - SECONDS )) cmd rc
  mkdir -p "$dir"
  if (( left < 60 )); then echo "$name: skipped, ${left}s of ${BUDGET}s left" > "$dir/result.txt"; return; fi
  case $name in
    grpo)        cmd=(env PHASES=grpo bash scripts/gpu/sglang.sh) ;;
    grpo_tp2)    cmd=(env PHASES=grpo bash scripts/gpu/sglang.sh actor.parallel.world_size=2 actor.parallel.tp=2
                      rollout.sglang_tp=2) ;;
    grpo_disagg) cmd=(env PHASES=grpo_disagg bash scripts/gpu/sglang.sh) ;;
    grpo_tp2_sharded) cmd=(env PHASES=grpo bash scripts/gpu/sglang.sh actor.parallel.world_size=2 actor.parallel.tp=2
                      rollout.sglang_tp=2 rollout.weight_delivery=sharded model.tiny_vocab_multiple=128) ;;
    reshard_tp2) cmd=(env PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
                      NCCL_CUMEM_ENABLE=0 OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone
                      --nproc-per-node 2 benchmarks/multi_gpu.py reshard --tp 2 --gen-tp 2 --delivery full sharded
                      --size 7b --seq 1024 --train-steps 0 --bucket-mb 8192 --trials 2 --mem-fraction 0.6
                      --startup-timeout 400 --log-dir "$dir" --work-dir /tmp/megarl-reshard-tp2 --out "$dir/reshard_tp2.json") ;;
    *)           cmd=(env PARTS="$name" BUDGET=$(( left - 20 )) bash scripts/gpu/weight_sync.sh) ;;
  esac
  echo "[$(date +%T)] $name on GPUs $gpus starts, ${left}s left"
  CUDA_VISIBLE_DEVICES=$gpus OUT="$dir" timeout -k 20 "$left" "${cmd[@]}" > "$dir/stdout.txt" 2>&1
  rc=$?
  echo "$name on GPUs $gpus: exit $rc at ${SECONDS}s" | tee "$dir/result.txt"
}

lane() {
  local token
  for token in $1; do
    if [[ $token == wait:* ]]; then
      while [ ! -e "$OUT/${token#wait:}/result.txt" ]; do sleep 2; done
    else
      step "${token#*=}" "${token%%=*}"
    fi
  done
}

IFS=';' read -ra lanes <<< "$LANES"
for spec in "${lanes[@]}"; do lane "$spec" & done
wait
echo "== sync_lanes.sh on $(wc -l < "$OUT/gpus.txt") x $(head -1 "$OUT/gpus.txt" | cut -d, -f2), lanes [$LANES], ${SECONDS}s"
for spec in "${lanes[@]}"; do
  for token in $spec; do
    [[ $token == wait:* ]] && continue
    echo "---- $(cat "$OUT/${token#*=}/result.txt" 2>/dev/null)"
    tail -n 14 "$OUT/${token#*=}/stdout.txt" 2>/dev/null
  done
done
tar -czf /tmp/megarl-sync-lanes-all.tgz --exclude="*.safetensors" -C "$OUT" . \
  && mv /tmp/megarl-sync-lanes-all.tgz "$OUT/all.tgz"
