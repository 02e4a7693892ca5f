"""Print a short table of one run from its metrics.jsonl: median step time, phase times, throughput, reward.

    python scripts/summarize_run.py runs/quickstart                 # the newest run of that output root
    python scripts/summarize_run.py runs/quickstart --run 20261206-225102-3f9a
    python scripts/summarize_run.py runs/quickstart/logs/<run id>   # a run's own directory, or a metrics .jsonl

Every mode's rows are read (sync, one_step_off, async): a phase's median is over the steps that timed it, and the
table says on how many steps that was where it is not all of them (an async run's first step has no pause).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from megarl.utils.tracking import run_dir


def metrics_file(path: str, run_id: str | None = None) -> Path:
    """The metrics.jsonl that `path` means: a .jsonl file; a run's directory; or an output root's run `run_id`,
    by default its newest."""
    path = Path(path)
    if path.is_file():
        return path
    if run_id is None and (path / "metrics.jsonl").is_file():
        return path / "metrics.jsonl"
    found = run_dir(path, run_id) / "metrics.jsonl"
    if not found.is_file():
        raise FileNotFoundError(f"no metrics.jsonl for run {run_id} in {path}")
    return found


def summarize(path: str, skip: int = 2, run_id: str | None = None) -> str:
    source = metrics_file(path, run_id)
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step" in r][skip:]  # the first steps include warm-up
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    lines = [f"{source}", "", f"| metric ({len(steps)} steps after {skip} warm-up) | median |", "| --- | --- |"]
    for key in sorted({k for r in steps for k in r if k.startswith(("timing/", "perf/"))}):
        values = [r[key] for r in steps if key in r]
        counted = f" ({len(values)} steps)" if len(values) < len(steps) else ""
        lines.append(f"| {key}{counted} | {statistics.median(values):.4g} |")
    if val:
        lines.append(f"| val/reward step {val[0][0]} -> {val[-1][0]} | {val[0][1]:.3f} -> {val[-1][1]:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="an output root (trainer.output_dir), a run's directory, or a metrics .jsonl")
    parser.add_argument("skip", nargs="?", type=int, default=2, help="warm-up steps left out (default 2)")
    parser.add_argument("--run", help="the run id, under the output root's logs/ (default: the newest run)")
    args = parser.parse_args()
    try:
        print(summarize(args.path, args.skip, args.run))
    except FileNotFoundError as e:
        sys.exit(f"summarize_run: {e}")
