#!/usr/bin/env bash
# GPU run of issue 5 on one GPU (one H200: ~3 min per phase, each cut at 270 s): multi-turn tool use with a
# real SGLang server, colocated with the Megatron policy. Every phase prints per step: reward, turns, tool
# calls, turns/s and model tokens/s of generation (turns of ready conversations batched into one request,
# each with its own token limit; conversation ids for sticky routing).
#   recipe     - configs/tool_calculator.yaml exactly as on CPU (its tiny model, SFT warm start on the
#                calculator traces, 60% unaided / 40% through the tool), rollouts by SGLang; 6 GRPO steps,
#                held-out reward at 0, 3 and 6 (CPU: 0.16 -> 0.42 after 10 steps, docs/benchmarks.md)
#   wide       - a wider tiny model (256 hidden, 4 layers) and 32 prompts x 8 conversations per step: more
#                work per SGLang call for throughput; its shorter SFT leaves the reward near 0 (no learning
#                claim: throughput only)
#   oversample - wide with agent.oversample_groups: more groups started than needed, the rest aborted
#                through SGLang's /abort_request and resumed the next step
# PHASES="recipe" by default; logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/megarl-agent}; mkdir -p "$OUT"
PHASES=${PHASES:-recipe}
RUN=/tmp/megarl-agent-run
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/gpu_free.sh  # GPU memory in use at start; loud warning above ~1 GB
rm -rf "$RUN"; mkdir -p "$RUN"
python3 scripts/make_tool_traces.py --out "$RUN/traces.jsonl" --n 4000 > "$OUT/traces.log" 2>&1 || { cat "$OUT/traces.log"; exit 1; }
status=0

table() {  # metrics.jsonl -> markdown rows
  python3 - "$1" "$2" <<'PY'
import json, sys
path, phase = sys.argv[1], sys.argv[2]
try:
    rows = [json.loads(l) for l in open(path)]
except OSError:
    print(f"{phase}: no metrics ({path})"); sys.exit(0)
out = []
for r in rows:
    if "agent/model_turns_total" not in r:
        continue
    gen = r.get("timing/generate") or float("nan")
    out.append({"phase": phase, "step": r.get("step"), "reward": r.get("train/reward"), "turns": r.get("agent/turns"),
                "tool_calls": r.get("agent/tool_calls"), "tool_error_rate": r.get("agent/tool_error_rate"),
                "generate_s": gen, "turns_per_s": r["agent/model_turns_total"] / gen,
                "tokens_per_s": r["agent/model_tokens_total"] / gen,
                "aborted": r.get("agent/groups_aborted"), "resumed": r.get("agent/groups_resumed"),
                "val_reward": r.get("val/reward")})
json.dump(out, open(path.replace(".jsonl", "_throughput.json"), "w"), indent=1)
print("| phase | step | reward | turns | tool calls | generate s | turns/s | tokens/s | aborted | resumed | val |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
f = lambda v: "" if v is None else f"{v:.4g}"
for o in out:
    print(f"| {phase} | {o['step']} | {f(o['reward'])} | {f(o['turns'])} | {f(o['tool_calls'])} | {f(o['generate_s'])} "
          f"| {f(o['turns_per_s'])} | {f(o['tokens_per_s'])} | {f(o['aborted'])} | {f(o['resumed'])} | {f(o['val_reward'])} |")
PY
}

run_phase() {  # name, extra overrides...
  local name=$1; shift
  rm -rf "$RUN/$name"
  timeout 270 python3 -m megarl.train --config configs/tool_calculator.yaml trainer.device=cuda \
    rollout.engine=sglang rollout.sglang_mem_fraction=0.3 trainer.cpus_per_rank=1 sft.data="$RUN/traces.jsonl" \
    trainer.loggers=console,jsonl trainer.output_dir="$RUN/$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 20 "$OUT/$name.log"
  cp "$RUN/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  ls "$RUN/$name"/sglang_*.log >/dev/null 2>&1 && tail -n 40 "$RUN/$name"/sglang_*.log > "$OUT/${name}_sglang_server.log"
  echo "== $name: exit $rc"
  return $rc
}

WIDE=(model.tiny_hidden_size=256 model.tiny_num_layers=4 model.tiny_num_heads=4 model.tiny_num_kv_heads=2
      sft.steps=300 sft.batch_size=64 sft.lr=2e-3 actor.optim.lr=2e-4 data.prompts_per_step=32 rollout.n_samples=8
      data.val_size=64 actor.micro_batch_size=64 trainer.steps=4 trainer.eval_every=4)
for name in $PHASES; do
  case $name in
    recipe)     run_phase recipe trainer.steps=6 trainer.eval_every=3 "$@" ;;
    wide)       run_phase wide "${WIDE[@]}" "$@" ;;
    oversample) run_phase oversample "${WIDE[@]}" agent.oversample_groups=16 "$@" ;;
    *)          echo "unknown phase $name"; false ;;
  esac
  status=$(( status | $? ))
done
for name in $PHASES; do table "$OUT/${name}_metrics.jsonl" "$name"; done
echo "== agent.sh phases [$PHASES] on $(cat "$OUT/gpu.txt"): exit $status"
exit $status
