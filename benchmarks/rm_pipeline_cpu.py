"""The RLHF pipeline on a CPU, end to end: preferences built offline -> reward model -> RL against it.

1. Preferences from the quickstart's task (string reversal, megarl/data/tasks.py): for each prompt "abcd>", chosen
   the reversed string "dcba", rejected a wrong answer (a near miss: one letter replaced, two swapped, one dropped
   or one added; or one that runs on, or the word unreversed: megarl.data.preferences.corrupt), written as
   prompt/chosen/rejected .jsonl files (train: the task's training split; held-out: its validation split). A control
   copy of the training file swaps chosen and rejected in a random half of the rows: labels that say nothing.
2. Two reward models, by python -m megarl.train_rm --config configs/rm_quickstart.yaml on those files: the real one
   and the shuffled-label control, held-out pair accuracy on the true labels before and after.
3. Three RL runs, by python -m megarl.train --config configs/rm_grpo_quickstart.yaml (the same supervised warm start,
   then GRPO whose reward is the reward model's score, normalised by its running mean and std): against the real
   reward model, the same with the learning rate 0 (control), and against the shuffled-label reward model. Each
   reports the task's rule reward (exact match) on held-out prompts before and after RL: RL never sees that reward.

    python benchmarks/rm_pipeline_cpu.py --out runs/rm_pipeline        # ~1 h on 2 busy cores
    python benchmarks/rm_pipeline_cpu.py --out /tmp/rmp --rm-steps 20 --rl-steps 2 --sft-steps 5   # smoke
    python benchmarks/rm_pipeline_cpu.py --out runs/rm_pipeline_seed3 --seed 3 --reward-models runs/rm_pipeline
                                        # only step 3, another seed's RL against the reward models of an earlier run

Prints the tables last and writes <out>/results.json (--report: only that, from the runs already there). Each run
keeps its own directory (TensorBoard events, metrics.jsonl, logs) under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megarl.data.files import write_records  # noqa: E402
from megarl.data.preferences import task_preferences  # noqa: E402
from megarl.utils.tracking import run_metrics  # noqa: E402


def write_preferences(out: Path, pairs: int, val: int, seed: int) -> dict[str, Path]:
    """train.jsonl, val.jsonl and train_shuffled.jsonl (chosen and rejected swapped in a random half of the rows)."""
    train = task_preferences("reverse", pairs, seed, "train", 3, 5)
    held_out = task_preferences("reverse", val, seed, "val", 3, 5)
    rng = random.Random(seed)
    shuffled = [dict(row, chosen=row["rejected"], rejected=row["chosen"]) if rng.random() < 0.5 else dict(row)
                for row in train]
    files = {"train": out / "train.jsonl", "val": out / "val.jsonl", "train_shuffled": out / "train_shuffled.jsonl"}
    for name, rows in (("train", train), ("val", held_out), ("train_shuffled", shuffled)):
        write_records(files[name], [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    return files


def run(name: str, command: list[str], out: Path) -> float:
    """One megarl command, its output in <out>/<name>.log; returns its wall seconds (raises if it failed)."""
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", *command], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{name} failed (exit {done.returncode}); see {out / f'{name}.log'}")
    print(f"{name}: {seconds:.0f} s", flush=True)
    return seconds


def metric(run_dir: Path, name: str) -> dict[int, float]:
    rows = [json.loads(line) for line in run_metrics(run_dir).read_text().splitlines()]
    return {row["step"]: row[name] for row in rows if name in row}


RL_RUNS = {"rl_rm": ("rm", []), "rl_rm_lr0": ("rm", ["actor.optim.lr=0"]), "rl_rm_shuffled": ("rm_shuffled", [])}
RL_METRICS = ("val/reward", "train/rule_reward", "train/rm_score", "train/unfinished", "train/response_length")


def mean_of_last(by_step: dict[int, float], n: int = 10) -> float:
    values = [by_step[s] for s in sorted(by_step)[-n:]]
    return sum(values) / len(values)


def report(out: Path, seconds: dict[str, float]) -> dict:
    """results.json from the runs' metrics.jsonl, and the tables (printed last)."""
    results = {"reward_models": {name: {"seconds": seconds.get(name), "val/pair_accuracy":
                                        metric(out / name, "val/pair_accuracy"),
                                        "val/margin": metric(out / name, "val/margin")}
                                 for name in ("rm", "rm_shuffled") if run_metrics(out / name).exists()},
               "rl": {name: {"seconds": seconds.get(name), "reward_model": reward_model, "overrides": extra}
                      | {key: metric(out / name, key) for key in RL_METRICS}
                      for name, (reward_model, extra) in RL_RUNS.items() if run_metrics(out / name).exists()}}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n| reward model | held-out pair accuracy before -> after | margin after | seconds |")
    print("| --- | --- | --- | --- |")
    for name, r in results["reward_models"].items():
        acc, margin = r["val/pair_accuracy"], r["val/margin"]
        print(f"| {name} | {acc[min(acc)]:.3f} -> {acc[max(acc)]:.3f} | {margin[max(margin)]:.3f} "
              f"| {r['seconds'] or 0:.0f} |")
    print("\n| RL run | reward model | overrides | held-out rule reward (exact match, mean@4) before -> after "
          "| last 10 steps: rule reward / rm score / unfinished / length | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results["rl"].items():
        val = r["val/reward"]
        last = " / ".join(f"{mean_of_last(r[key]):.3g}" for key in RL_METRICS[1:])
        print(f"| {name} | {r['reward_model']} | {' '.join(r['overrides']) or '-'} | {val[min(val)]:.3f} -> "
              f"{val[max(val)]:.3f} | {last} | {r['seconds'] or 0:.0f} |")
    return results


def train_reward_models(out: Path, args: argparse.Namespace) -> dict[str, float]:
    """Steps 1-2: the preference files, then rm and rm_shuffled in <out>; returns their wall seconds."""
    files = write_preferences(out, args.pairs, args.val_pairs, args.seed)
    seconds = {}
    for name, train_file in (("rm", files["train"]), ("rm_shuffled", files["train_shuffled"])):
        seconds[name] = run(name, ["megarl.train_rm", "--config", "configs/rm_quickstart.yaml",
                                   f"preference.train={train_file}", f"preference.val={files['val']}",
                                   f"preference.val_size={args.val_pairs}", f"trainer.steps={args.rm_steps}",
                                   f"trainer.eval_every={max(1, args.rm_steps // 8)}",
                                   f"trainer.output_dir={out / name}", f"trainer.seed={args.seed}"], out)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/rm_pipeline"))
    parser.add_argument("--pairs", type=int, default=10000, help="training preference pairs")
    parser.add_argument("--val-pairs", type=int, default=256)
    parser.add_argument("--rm-steps", type=int, default=3000)
    parser.add_argument("--rl-steps", type=int, default=120)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="only the tables, from the runs already in --out")
    parser.add_argument("--reward-models", type=Path, default=None,
                        help="an earlier run's --out whose rm and rm_shuffled the RL runs use (steps 1-2 skipped)")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.report:
        report(out, {})
        return
    out.mkdir(parents=True, exist_ok=True)
    reward_models = args.reward_models.resolve() if args.reward_models else out
    seconds = {} if args.reward_models else train_reward_models(out, args)
    for name, (reward_model, extra) in RL_RUNS.items():
        seconds[name] = run(name, ["megarl.train", "--config", "configs/rm_grpo_quickstart.yaml",
                                   f"reward_model.path={reward_models / reward_model / 'reward_model'}",
                                   f"trainer.steps={args.rl_steps}", f"trainer.eval_every={max(1, args.rl_steps // 6)}",
                                   f"sft.steps={args.sft_steps}", f"trainer.output_dir={out / name}",
                                   f"trainer.seed={args.seed}", *extra], out)
    report(out, seconds)


if __name__ == "__main__":
    main()
