#!/usr/bin/env bash
# Agents through the OpenAI-compatible gateway against the built-in agent loop, on one GPU with SGLang colocated
# (one H100/H200: ~6 min, each phase cut at 270 s). The same workload twice: the calculator task of
# configs/tool_calculator.yaml, a tiny-tokenizer Qwen2 (256 hidden, 4 layers) after the same SFT warm start, 32
# prompts x 8 samples a step, 4 GRPO steps:
#   loop     - the built-in agent loop (configs/tool_calculator.yaml): turns of ready conversations batched into one
#              SGLang request, the calculator run in-process.
#   gateway  - configs/gateway_calculator.yaml: megarl/recipes/calculator_agent.py, written only against the openai
#              client, 256 runs at once (agent.gateway.max_concurrent), each HTTP request to the gateway a model turn.
# Per step: requests/s (loop: model turns/s; gateway: HTTP requests/s) and model tokens/s over the generate phase
# (timing/generate), and the gateway/loop ratio of their means over steps 2-4 (step 1 includes warm-up).
# PHASES="loop gateway" by default; logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-gateway}; mkdir -p "$OUT"
PHASES=${PHASES:-loop gateway}
RUN=/tmp/megarl-gateway-run
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
rm -rf "$RUN"; mkdir -p "$RUN"
python3 scripts/make_tool_traces.py --out "$RUN/traces.jsonl" --n 4000 > "$OUT/traces.log" 2>&1 || { cat "$OUT/traces.log"; exit 1; }
status=0

run_phase() {  # name, recipe, extra overrides...
  local name=$1 recipe=$2; shift 2
  rm -rf "$RUN/$name"
  timeout 270 python3 -m megarl.train --config "$recipe" trainer.device=cuda \
    rollout.engine=sglang rollout.sglang_mem_fraction=0.3 trainer.cpus_per_rank=1 \
    model.tiny_hidden_size=256 model.tiny_num_layers=4 model.tiny_num_heads=4 model.tiny_num_kv_heads=2 \
    sft.data="$RUN/traces.jsonl" sft.steps=300 sft.batch_size=64 sft.lr=2e-3 actor.optim.lr=2e-4 \
    data.prompts_per_step=32 rollout.n_samples=8 data.val_size=64 actor.micro_batch_size=64 \
    trainer.steps=4 trainer.eval_every=4 trainer.loggers=console,jsonl trainer.output_dir="$RUN/$name" \
    "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 20 "$OUT/$name.log"
  cp "$(ls -d "$RUN/$name"/logs/*/ 2>/dev/null | tail -1)metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  ls "$RUN/$name"/sglang_*.log >/dev/null 2>&1 && tail -n 40 "$RUN/$name"/sglang_*.log > "$OUT/${name}_sglang_server.log"
  echo "== $name: exit $rc"
  return $rc
}

if [[ " $PHASES " == *" loop "* ]]; then
  run_phase loop configs/tool_calculator.yaml "$@"; status=$(( status | $? ))
fi
if [[ " $PHASES " == *" gateway "* ]]; then
  run_phase gateway configs/gateway_calculator.yaml agent.gateway.max_concurrent=256 agent.gateway.timeout_s=200 "$@"
  status=$(( status | $? ))
fi
python3 scripts/gpu/gateway_table.py "$OUT" $PHASES
echo "== gateway.sh phases [$PHASES] on $(cat "$OUT/gpu.txt"): exit $status"
exit $status
