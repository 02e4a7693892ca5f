#!/usr/bin/env bash
# The learning evidence of configs/gateway_calculator.yaml on CPU: an agent written only against the openai client
# (megarl/recipes/calculator_agent.py) trained through the gateway, against a learning-rate-0 control (same seed,
# same traces, same warm start, same held-out prompts), one after the other, both dumping their held-out rollouts.
# A gateway run's draws follow the order in which its agents' turns reach the engine (which turns share an engine
# call), so the two runs' held-out numbers at step 0 may differ by sampling noise.
# Prints, per evaluation, from the dumps: the held-out reward (the agent's own: 0.5 for a calculator result that was
# the answer + 0.5 for the exact final answer), the share of held-out runs with full reward (success) and with at
# least half of it; then each run's wall time (the table also in $OUT/table.md). The defaults: the recipe's warm
# start (400 SFT steps on 4000 traces), then 10 GRPO steps (the recipe's 30 learn too, but the warm start is most of
# a CPU run's time), held-out every 5 steps, all 128 runs of a step at once (agent.gateway.max_concurrent=128: the
# hf engine batches the turns that arrive together). Extra arguments are overrides for both runs; each run's
# metrics.jsonl is copied to $OUT/<run>_metrics.jsonl.
#   bash scripts/gateway_learning.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/gateway_learning}
rm -rf "$OUT"; mkdir -p "$OUT"
$PY scripts/make_tool_traces.py --out "$OUT/traces.jsonl"
for run in recipe control; do
  lr=(); [[ $run == control ]] && lr=(actor.optim.lr=0)
  start=$SECONDS
  $PY -m megarl.train --config configs/gateway_calculator.yaml sft.data="$OUT/traces.jsonl" "${lr[@]}" \
    trainer.output_dir="$OUT/$run" rollout.dump_dir="$OUT/$run/dump" trainer.loggers=jsonl \
    trainer.steps=10 trainer.eval_every=5 agent.gateway.max_concurrent=128 "$@" > "$OUT/$run.log" 2>&1
  cp "$OUT/$run"/logs/*/metrics.jsonl "$OUT/${run}_metrics.jsonl"
  echo "$run: $((SECONDS - start)) s" >> "$OUT/times.txt"
done
$PY - "$OUT" <<'PY' | tee "$OUT/table.md"
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
print("| run | step | held-out reward | success (reward 1) | reward >= 0.5 | runs |")
print("| --- | --- | --- | --- | --- | --- |")
for run in ("recipe", "control"):
    for path in sorted((out / run / "dump").glob("val_*.pt"), key=lambda p: int(p.stem.split("_")[1])):
        rewards = torch.load(path, weights_only=False)["tensors"]["rewards"]
        n = len(rewards)
        print(f"| {run} | {int(path.stem.split('_')[1])} | {rewards.mean().item():.3f} "
              f"| {(rewards == 1).float().mean().item():.3f} | {(rewards >= 0.5).float().mean().item():.3f} | {n} |")
print((out / "times.txt").read_text(), end="")
PY
