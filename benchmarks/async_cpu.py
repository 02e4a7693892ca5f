"""Does asynchronous training still learn? The CPU comparison: the training modes on the same recipes.

    python -m benchmarks.async_cpu --out-dir runs/async_cpu                 # everything: hours on 2 cores
    python -m benchmarks.async_cpu --out-dir runs/async_smoke --smoke       # one seed, a few steps: minutes

For each recipe (configs/quickstart.yaml, configs/tool_calculator.yaml), mode (sync; one_step_off; async at
async.max_staleness 1 and 4) and seed, one `python -m megarl.train` run with the recipe's own settings, so every
mode trains on the same number of samples (trainer.steps x data.prompts_per_step x rollout.n_samples) from the
same warm start, and is evaluated on the same held-out draws; held-out evaluation before RL and after the last
step only (trainer.eval_every=0). A run that finished before (its metrics.jsonl has the last step's val/reward)
is read, not redone, so the script can be stopped and run again. Prints a table last: per recipe and mode the
final held-out reward (mean of the seeds, and each), the goal (at least the sync run's mean minus 0.05), the mean
step time, tokens/s/GPU and the mean staleness of the trained samples. Writes OUT/async_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megarl.config.tiny import tiny_config
from megarl.utils.provenance import source_commit
from megarl.utils.tracking import run_metrics

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "one_step_off": ["trainer.mode=one_step_off"],
         "async_1": ["trainer.mode=async", "async.max_staleness=1"],
         "async_4": ["trainer.mode=async", "async.max_staleness=4"]}
RECIPES = {"quickstart": ("configs/quickstart.yaml", ["trainer.steps=40"]),
           "tool_calculator": ("configs/tool_calculator.yaml", [])}
SMOKE = ["trainer.steps=3", "sft.steps=20", "data.val_size=8"]
TOLERANCE = 0.05  # the goal: a mode's mean final held-out reward >= the sync run's mean minus this


def final_reward(metrics: Path, steps: int) -> float | None:
    """val/reward after step `steps`, if the run got there."""
    if not metrics.exists():
        return None
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row["step"] == steps and "val/reward" in row:
            return row["val/reward"]
    return None


def summary(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "timing/step" in r]

    def mean(key):
        values = [r[key] for r in steps if key in r]
        return statistics.mean(values) if values else None
    return {"step_s": mean("timing/step"), "tokens_per_s_per_gpu": mean("perf/tokens_per_s_per_gpu"),
            "staleness": mean("async/staleness_mean") or 0.0, "train_reward": mean("train/reward")}


def run(recipe: str, mode: str, seed: int, out: Path, smoke: bool, timeout: float) -> dict:
    config, overrides = RECIPES[recipe]
    overrides = overrides + (SMOKE if smoke else []) + MODES[mode]
    steps = tiny_config(overrides, path=ROOT / config).trainer.steps
    directory = out / recipe / f"{mode}_seed{seed}"
    reward = final_reward(run_metrics(directory), steps)
    seconds = None
    if reward is None:
        directory.mkdir(parents=True, exist_ok=True)
        (run_metrics(directory)).unlink(missing_ok=True)
        extra = [f"sft.data={out / 'traces.jsonl'}"] if recipe == "tool_calculator" else []
        command = [sys.executable, "-m", "megarl.train", "--config", str(ROOT / config), *overrides, *extra,
                   f"trainer.seed={seed}", "trainer.eval_every=0", f"trainer.output_dir={directory}",
                   "trainer.loggers=[jsonl]"]
        for attempt in range(2):  # a second try for a local Ray that failed to start on a loaded machine
            start = time.perf_counter()
            with open(directory / f"log{attempt}.txt", "w") as log:
                done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            seconds = time.perf_counter() - start
            reward = final_reward(run_metrics(directory), steps)
            ray_failed = "node timed out during startup" in (directory / f"log{attempt}.txt").read_text()
            if reward is not None or not ray_failed:
                break
            (run_metrics(directory)).unlink(missing_ok=True)
        if done.returncode or reward is None:
            print(f"{recipe} {mode} seed {seed}: failed (exit {done.returncode}); see {directory}/log*.txt", flush=True)
            return {"recipe": recipe, "mode": mode, "seed": seed, "failed": True}
    result = {"recipe": recipe, "mode": mode, "seed": seed, "final_reward": reward, "wall_s": seconds,
              **summary(run_metrics(directory))}
    print(json.dumps(result), flush=True)
    return result


def table(results: list[dict]) -> str:
    lines = ["| recipe | mode | final held-out reward (mean) | per seed | goal (sync - 0.05) | step s | "
             "tokens/s/GPU | staleness |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for recipe in RECIPES:
        done = [r for r in results if r["recipe"] == recipe and not r.get("failed")]
        sync = [r["final_reward"] for r in done if r["mode"] == "sync"]
        floor = statistics.mean(sync) - TOLERANCE if sync else None
        for mode in MODES:
            runs = [r for r in done if r["mode"] == mode]
            if not runs:
                continue
            reward = statistics.mean(r["final_reward"] for r in runs)
            seeds = ", ".join(f"{r['final_reward']:.3f}" for r in runs)
            goal = "-" if floor is None or mode == "sync" else ("met" if reward >= floor else "NOT met")
            lines.append(f"| {recipe} | {mode} | {reward:.3f} | {seeds} | {goal} | "
                         f"{statistics.mean(r['step_s'] for r in runs):.2f} | "
                         f"{statistics.mean(r['tokens_per_s_per_gpu'] for r in runs):.0f} | "
                         f"{statistics.mean(r['staleness'] for r in runs):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--smoke", action="store_true", help="a few steps and a short warm start (a check of the "
                                                             "script, not of learning)")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="deadline of one run")
    args = parser.parse_args(argv)
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if "tool_calculator" in args.recipes and not (out / "traces.jsonl").exists():
        subprocess.run([sys.executable, "scripts/make_tool_traces.py", "--out", str(out / "traces.jsonl")], cwd=ROOT,
                       check=True)
    results = [run(recipe, mode, seed, out, args.smoke, args.timeout_s)
               for recipe in args.recipes for seed in args.seeds for mode in args.modes]
    (out / "async_cpu.json").write_text(json.dumps({"commit": source_commit(), "smoke": args.smoke,
                                                    "results": results}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
