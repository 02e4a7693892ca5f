#!/usr/bin/env bash
# The learning evidence of configs/tool_calculator.yaml on CPU: the recipe against a learning-rate-0 control
# (same seed, same warm start), both dumping their held-out rollouts. Prints, per evaluation, the held-out
# reward and the fraction of held-out conversations with a correct tool call (a calculator call that
# returned the answer), read from the dumps. Extra arguments are overrides for both runs.
#   bash scripts/tool_calculator_compare.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/tool_calculator_compare}
mkdir -p "$OUT"
$PY scripts/make_tool_traces.py --out "$OUT/traces.jsonl"
for lr in 5e-4 0; do
  $PY -m megarl.train --config configs/tool_calculator.yaml sft.data="$OUT/traces.jsonl" actor.optim.lr=$lr \
    trainer.output_dir="$OUT/lr$lr" rollout.dump_dir="$OUT/lr$lr/dump" trainer.loggers=jsonl "$@" \
    > "$OUT/lr$lr.log" 2>&1
done
$PY - "$OUT" <<'PY'
import sys
from pathlib import Path

import torch

from megarl.rewards.tool_use import tool_returned

out = Path(sys.argv[1])
print("| run | step | held-out reward | correct tool calls | tool calls / sample | tool errors |")
print("| --- | --- | --- | --- | --- | --- |")
for run in ("lr5e-4", "lr0"):
    for path in sorted((out / run / "dump").glob("val_*.pt")):
        d = torch.load(path, weights_only=False)
        nt, rewards = d["non_tensors"], d["tensors"]["rewards"]
        correct = sum(tool_returned(t, a) for t, a in zip(nt["trajectory"], nt["answer"])) / len(rewards)
        calls = [c for t in nt["trajectory"] for turn in t["turns"] if turn["role"] == "tool" for c in turn["calls"]]
        print(f"| {run} | {int(path.stem.split('_')[1])} | {rewards.mean().item():.3f} | {correct:.3f} "
              f"| {len(calls) / len(rewards):.2f} | {sum(c['error'] for c in calls) / max(len(calls), 1):.2f} |")
PY
