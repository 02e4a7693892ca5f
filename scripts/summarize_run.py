"""Print a short table of a run from its metrics.jsonl: median step time, phase times, throughput, reward."""

import json
import statistics
import sys
from pathlib import Path


def summarize(run_dir: str, skip: int = 2) -> str:
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/step" in r][skip:]  # the first steps include warm-up
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    lines = [f"| metric ({len(steps)} steps after {skip} warm-up) | median |", "| --- | --- |"]
    for key in sorted({k for r in steps for k in r if k.startswith(("timing/", "perf/"))}):
        lines.append(f"| {key} | {statistics.median(r[key] for r in steps):.4g} |")
    if val:
        lines.append(f"| val/reward step {val[0][0]} -> {val[-1][0]} | {val[0][1]:.3f} -> {val[-1][1]:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1], *(int(a) for a in sys.argv[2:])))
