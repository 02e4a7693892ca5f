"""Tool-call traces for the supervised warm start of configs/tool_calculator.yaml, made offline.

Each trace answers a training prompt of a built-in task (default `mul`, "37*58="). A share of them
(--direct-share) answer at once, without the tool, as a model working it out unaided would (the
right product: the tiny model cannot learn to multiply from a few thousand of them, so its unaided
answers are mostly wrong); the others go through the calculator: a turn that calls it, the tool's
result (computed by the real tool), and a turn that gives the result as the answer. The warm-started
policy then does both, and RL has a choice to learn: the reward (the right answer) needs the tool.
Rows: {prompt, answer, messages: [{role, content}]}, the layout that sft.data reads
(megarl.data.dataset.sft_batch). Only the task's training split is used, so held-out prompts never
appear in a trace.

    python scripts/make_tool_traces.py --out runs/tool_calculator/traces.jsonl [--n 4000] [--direct-share 0.6]
"""

from __future__ import annotations

import argparse
import json
import random

from megarl.data.files import write_records
from megarl.data.tasks import make_task
from megarl.rollout.tools.calculator import Calculator


def make_traces(task: str, n: int, seed: int, min_len: int, max_len: int, direct_share: float = 0.6) -> list[dict]:
    if not 0 <= direct_share <= 1:
        raise ValueError(f"--direct-share must be in [0, 1], got {direct_share}")
    calculator = Calculator()
    direct = random.Random(seed)  # which traces answer without the tool
    traces = []
    for ex in make_task(task, min_len=min_len, max_len=max_len).make_examples(n, seed, "train"):
        if direct.random() < direct_share:
            traces.append(dict(ex, messages=[{"role": "assistant", "content": ex["answer"]}]))
            continue
        expression = ex["prompt"].rstrip("=")
        call = {"name": "calculator", "arguments": {"expression": expression}}
        result = calculator.run(expression=expression)
        if result != ex["answer"]:
            raise ValueError(f"the calculator gives {result} for {expression}, the task's answer is {ex['answer']}")
        traces.append(dict(ex, messages=[
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]))
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help=".jsonl file to write")
    parser.add_argument("--task", default="mul")
    parser.add_argument("--n", type=int, default=4000, help="traces (distinct training prompts)")
    parser.add_argument("--direct-share", type=float, default=0.6,
                        help="share of traces that answer without the tool (0 = all use the calculator)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-len", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=2)
    args = parser.parse_args()
    write_records(args.out, make_traces(args.task, args.n, args.seed, args.min_len, args.max_len,
                                         args.direct_share))
    print(f"wrote {args.n} traces ({args.direct_share:.0%} without the tool) to {args.out}")


if __name__ == "__main__":
    main()
