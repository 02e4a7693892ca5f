#!/usr/bin/env bash
# The DeepSeek path at one-GPU scale on one H200, after the bundle's install.sh (../shared/device/README.md; the
# megatron chunk too for grpo, sync and optimizer). PARTS, each able to run alone (default all, in this order):
#   sglang     benchmarks/deepseek_sglang.py check, no megatron: a DeepSeek-V3-shaped checkpoint (MLA with DeepSeek-V3's
#              attention dimensions, YaRN, 16 routed experts with group-limited top-k and a routing bias, a shared
#              expert, a dense first layer) served by SGLang; its own load, then syncs in all three CUDA IPC formats,
#              each verified by checksums inside SGLang including the derived MLA tensors w_kc/w_vc; a flipped bit in
#              w_kc named; a bucket boundary between q_a_proj and kv_a_proj_with_mqa (SGLang drops both) named, and
#              kept together by push_policy; log-prob gap SGLang vs transformers before and after a sync   (~4 min)
#   transport  benchmarks/deepseek_sglang.py sync, no megatron: sync time and GB/s of a DeepSeek-V3-shaped model of
#              DeepSeek-V3's width (hidden 7168, 128 heads, q_lora 1536) with SYNC_LAYERS layers and 32 experts, from
#              HF tensors on the GPU (SGLang --load-format dummy), one verified sync                     (~3 min)
#   grpo       GRPO colocated with a real SGLang server on a DeepSeek-V3-shaped policy (GRPO_SHAPE), trained in
#              megatron after a short SFT, every sync verified by checksums inside SGLang; per step the log-prob gap
#              |SGLang - megatron| and the sync's seconds and GB/s                                        (~6 min)
#   sync       the largest DeepSeek-V3-shaped policy that trains beside SGLang here (SYNC_SHAPE): two GRPO steps, no
#              SFT; the trainer's sync seconds and GB/s (gather, convert, transfer) and its verification   (~6 min)
#   optimizer  the optimizer on the CPU (actor.optimizer_cpu_offload, distributed optimizer) against on the GPU: the
#              same SFT losses over OPT_STEPS steps, and the peak GPU memory of each beside the planner's
#              prediction (megarl.reshard.memory.predict_peak)                                            (~3 min)
# Shapes: "layers hidden heads experts moe_intermediate intermediate dense". Logs and JSON go to $OUT; a short table
# is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-deepseek}; mkdir -p "$OUT"
PARTS=${PARTS:-sglang transport grpo sync optimizer}
GRPO_SHAPE=${GRPO_SHAPE:-"6 2048 16 16 1408 5632 1"}    # ~0.9B parameters
# ~2.45B parameters. 32 experts (4.38B) fit the GPU but not the host: the engine's state offloaded between phases
# (~53 GB pinned, more while its buffer grows) ran a 125 GiB host out of memory.
SYNC_SHAPE=${SYNC_SHAPE:-"8 4096 32 16 1408 11008 1"}
SYNC_LAYERS=${SYNC_LAYERS:-8}                            # transport: ~12B parameters at DeepSeek-V3's width
OPT_SHAPE=${OPT_SHAPE:-"4 2048 16 16 1408 5632 1"}
OPT_STEPS=${OPT_STEPS:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
want() { [[ " $PARTS " == *" $1 "* ]]; }
# build_policy DIR "layers hidden heads experts moe_intermediate intermediate dense"
build_policy() {
  local dir=$1; read -r layers hidden heads experts moe inter dense <<< "$2"
  python3 benchmarks/deepseek_sglang.py build --out "$dir.json" --model-dir "$dir" --layers "$layers" \
    --hidden "$hidden" --heads "$heads" --experts "$experts" --moe-intermediate "$moe" --intermediate "$inter" \
    --dense "$dense" > "$dir.log" 2>&1
}
# grpo_run NAME SHAPE OVERRIDES...: the GSM8K-less quickstart task (string reversal) on SGLang, colocated
grpo_run() {
  local name=$1 shape=$2 run=/tmp/megarl-deepseek-$1-$$ rc
  shift 2
  rm -rf "$run"; mkdir -p "$run"
  build_policy "$run/model" "$shape" || { echo "$name: building the policy failed"; tail -n 20 "$run/model.log"; return 1; }
  cp "$run/model.json" "$OUT/${name}_model.json"
  timeout 560 python3 -m megarl.train --config configs/quickstart.yaml model.path="$run/model" trainer.device=cuda \
    actor.parallel.world_size=1 actor.parallel.tp=1 rollout.engine=sglang rollout.weight_delivery=full \
    trainer.verify_weight_sync_every=1 trainer.sync_bucket_mb=1024 actor.micro_batch_size=16 actor.optim.lr=2e-5 \
    trainer.cpus_per_rank=1 trainer.output_dir="$run" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log"
  cp "$(ls -d "$run"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  ls "$run"/sglang_*.log >/dev/null 2>&1 && tail -n 60 "$run"/sglang_*.log > "$OUT/${name}_sglang_server.log"
  return $rc
}
if want sglang; then
  timeout 480 python3 benchmarks/deepseek_sglang.py check --out "$OUT/sglang_check.json" --log-dir "$OUT" \
    > "$OUT/sglang_check.log" 2>&1
  rc=$?; status=$((status | rc)); tail -n 5 "$OUT/sglang_check.log"
fi
if want transport; then
  timeout 420 python3 benchmarks/deepseek_sglang.py sync --sync-layers $SYNC_LAYERS --bucket-mb 1024 \
    --out "$OUT/transport.json" --log-dir "$OUT" > "$OUT/transport.log" 2>&1
  rc=$?; status=$((status | rc)); tail -n 3 "$OUT/transport.log"
fi
if want grpo; then
  grpo_run grpo "$GRPO_SHAPE" sft.steps=30 sft.lr=1e-4 trainer.steps=4 trainer.eval_every=4
  status=$((status | $?))
fi
if want sync; then
  grpo_run sync "$SYNC_SHAPE" sft.steps=0 trainer.steps=2 trainer.eval_every=2 data.prompts_per_step=8 \
    rollout.n_samples=4 actor.use_distributed_optimizer=true
  status=$((status | $?))
fi
if want optimizer; then
  dir=/tmp/megarl-deepseek-optimizer-$$
  build_policy "$dir" "$OPT_SHAPE"
  for offload in false true; do
    timeout 280 python3 benchmarks/deepseek_optimizer.py --model-dir "$dir" --steps "$OPT_STEPS" \
      --cpu-offload "$offload" --out "$OUT/optimizer_$offload.json" > "$OUT/optimizer_$offload.log" 2>&1
    rc=$?; status=$((status | rc)); tail -n 3 "$OUT/optimizer_$offload.log"
  done
  # The bf16 MoE forward on the GPU is not bitwise repeatable (atomics in the token unpermute): a second on-GPU run
  # sizes that noise, the yardstick for the offloaded run's difference.
  timeout 280 python3 benchmarks/deepseek_optimizer.py --model-dir "$dir" --steps "$OPT_STEPS" --cpu-offload false \
    --out "$OUT/optimizer_repeat.json" > "$OUT/optimizer_repeat.log" 2>&1 && python3 - "$OUT" <<'PY'
import json, sys
runs = {k: json.load(open(f"{sys.argv[1]}/optimizer_{k}.json"))["losses"] for k in ("false", "repeat", "true")}
gap = lambda a, b: max(abs(x - y) for x, y in zip(runs[a], runs[b]))
print(f"max |loss diff|: GPU vs GPU repeat {gap('false', 'repeat'):.3e}, GPU vs CPU offload {gap('false', 'true'):.3e}")
PY
fi
python3 benchmarks/deepseek_sglang.py table --out "$OUT/table.md" --results "$OUT"
echo "== deepseek.sh [$PARTS] exit $status"
exit $status
