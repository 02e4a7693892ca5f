"""Print a short table of one run from its metrics.jsonl: median step time, phase times, throughput, reward.

    python scripts/summarize_run.py runs/quickstart                 # the newest run of that output root
    python scripts/summarize_run.py runs/quickstart --run 20261206-225102-3f9a
    python scripts/summarize_run.py runs/quickstart/logs/<run id>   # a run's own directory, or a metrics .jsonl
    python scripts/summarize_run.py --json runs/quickstart          # the same summary as JSON

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


def summary(path: str, skip: int = 2, run_id: str | None = None) -> dict:
    """One run's summary: the metrics file read, the steps counted, each timing/perf metric's median (with the number
    of steps that logged it) and the held-out reward at the first and the last evaluation."""
    source = metrics_file(path, run_id)
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step" in r][skip:]  # the first steps include warm-up
    medians = {}
    for key in sorted({k for r in steps for k in r if k.startswith(("timing/", "perf/"))}):
        values = [r[key] for r in steps if key in r]
        medians[key] = {"median": statistics.median(values), "steps": len(values)}
    val = [{"step": r["step"], "reward": r["val/reward"]} for r in rows if "val/reward" in r]
    return {"source": str(source), "steps": len(steps), "warmup_skipped": skip, "median": medians,
            "val_reward": {"first": val[0], "last": val[-1]} if val else None}


def summarize(path: str, skip: int = 2, run_id: str | None = None) -> str:
    """summary() as a markdown table."""
    s = summary(path, skip, run_id)
    lines = [s["source"], "", f"| metric ({s['steps']} steps after {skip} warm-up) | median |", "| --- | --- |"]
    for key, m in s["median"].items():
        counted = f" ({m['steps']} steps)" if m["steps"] < s["steps"] else ""
        lines.append(f"| {key}{counted} | {m['median']:.4g} |")
    if s["val_reward"]:
        first, last = s["val_reward"]["first"], s["val_reward"]["last"]
        lines.append(f"| val/reward step {first['step']} -> {last['step']} "
                     f"| {first['reward']:.3f} -> {last['reward']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="an output root (trainer.output_dir), a run's directory, or a metrics .jsonl")
    parser.add_argument("skip", nargs="?", type=int, default=2, help="warm-up steps left out (default 2)")
    parser.add_argument("--run", help="the run id, under the output root's logs/ (default: the newest run)")
    parser.add_argument("--json", action="store_true", help="the summary as JSON (the form docs/results/ records)")
    args = parser.parse_args()
    try:
        print(json.dumps(summary(args.path, args.skip, args.run), indent=1) if args.json else
              summarize(args.path, args.skip, args.run))
    except FileNotFoundError as e:
        sys.exit(f"summarize_run: {e}")
