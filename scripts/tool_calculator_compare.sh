#!/usr/bin/env bash
# The learning evidence of configs/tool_calculator.yaml on CPU: the recipe against a learning-rate-0 control
# (same seed, same traces, same warm start, same held-out draws), one after the other, both dumping their
# held-out rollouts. Prints, per evaluation, from the dumps: the held-out reward, the share of held-out
# conversations that call the tool at all, that make a correct tool call (a calculator call that returned
# the answer) and that end with the exact answer; then each run's wall time. Extra arguments are overrides
# for both runs.
#   bash scripts/tool_calculator_compare.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-runs/tool_calculator_compare}
rm -rf "$OUT"; mkdir -p "$OUT"
$PY scripts/make_tool_traces.py --out "$OUT/traces.jsonl"
for run in recipe control; do
  lr=(); [[ $run == control ]] && lr=(actor.optim.lr=0)
  start=$SECONDS
  $PY -m megarl.train --config configs/tool_calculator.yaml sft.data="$OUT/traces.jsonl" "${lr[@]}" \
    trainer.output_dir="$OUT/$run" rollout.dump_dir="$OUT/$run/dump" trainer.loggers=jsonl "$@" > "$OUT/$run.log" 2>&1
  echo "$run: $((SECONDS - start)) s" >> "$OUT/times.txt"
done
$PY - "$OUT" <<'PY'
import sys
from pathlib import Path

import torch

from megarl.rewards.tool_use import tool_returned

out = Path(sys.argv[1])
print("| run | step | held-out reward | calls the tool | correct tool call | exact answer | tool errors |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for run in ("recipe", "control"):
    for path in sorted((out / run / "dump").glob("val_*.pt")):
        d = torch.load(path, weights_only=False)
        nt, rewards = d["non_tensors"], d["tensors"]["rewards"]
        n = len(rewards)
        calls = [[c for turn in t["turns"] if turn["role"] == "tool" for c in turn["calls"]] for t in nt["trajectory"]]
        flat = [c for cs in calls for c in cs]
        correct = sum(tool_returned(t, a) for t, a in zip(nt["trajectory"], nt["answer"])) / n
        exact = sum(r.strip() == a.strip() for r, a in zip(nt["response"], nt["answer"])) / n
        print(f"| {run} | {int(path.stem.split('_')[1])} | {rewards.mean().item():.3f} | {sum(map(bool, calls)) / n:.3f} "
              f"| {correct:.3f} | {exact:.3f} | {sum(c['error'] for c in flat) / max(len(flat), 1):.2f} |")
print((out / "times.txt").read_text(), end="")
PY
