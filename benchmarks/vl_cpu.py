"""Does vision-language GRPO learn from the images? On a CPU, on configs/quickstart_vl.yaml
(--task count: "How many red squares?") or configs/quickstart_vl_colour.yaml (--task colour: "What colour is the
shape?"):

  images   the recipe: RL on the shapes images, held out on other images
  lr0      the same with actor.optim.lr=0: the warm start's held-out reward, unchanged by RL
  blank    the blank-image ablation: the same prompts and answers, every image white (train and held out), so only
           what text alone allows can be learned: answering the most frequent answer (the `text-only best` column)

    python -m benchmarks.vl_cpu [--task count|colour] [--seeds 0 1 2] [--out runs/vl_cpu] [key=value ...]
    python -m benchmarks.vl_cpu --table --out runs/vl_cpu       # the table of finished runs

Per seed: one tiny random Qwen2.5-VL (megarl/models/tiny_vl.py, the seed's) and one set of shapes prompt files
(megarl/data/shapes.py, the seed's), shared by the three runs; trainer.seed is the seed too. Every run has the same
warm start (supervised on the blank-image twins of the training prompts: the answer format and the answers' spread,
nothing from the images) and the same held-out draws. Each run is `python -m megarl.train` in a process of its own, one after
the other; a run whose metrics.jsonl has its last step's held-out reward is read, not redone. Extra key=value
arguments go to every run. Prints a table last (held-out mean@4 before RL and after the last step, per run and
seed); writes OUT/vl_cpu.json. Not part of the test suite: minutes per run on two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from megarl.config.tiny import tiny_config
from megarl.utils.tracking import run_metrics

RECIPES = {"count": "configs/quickstart_vl.yaml", "colour": "configs/quickstart_vl_colour.yaml"}
RUNS = ("images", "lr0", "blank")
VISION_INIT_STD = 0.1  # as scripts/quickstart_vl.sh builds the model: features that differ between images


def prepare(out: Path, seed: int, task: str) -> dict:
    """The seed's model directory and prompt files (written once)."""
    from megarl.data.shapes import write_shapes_splits
    from megarl.models.tiny_vl import build_tiny_vl_model

    base = out / f"seed{seed}"
    if not (base / "model" / "config.json").exists():
        build_tiny_vl_model(base / "model", seed=seed, vision_init_std=VISION_INIT_STD)
    splits = {name: base / "shapes" / name / "prompts.jsonl" for name in ("train", "val", "train_blank", "val_blank")}
    if not all(p.exists() for p in splits.values()):
        splits = write_shapes_splits(base / "shapes", seed=seed, task=task)
    return {"model": base / "model", **splits}


def overrides(run: str, seed: int, files: dict, out: Path) -> list[str]:
    blank = "_blank" if run == "blank" else ""
    return [f"model.path={files['model']}", f"data.task={files['train' + blank]}",
            f"data.val_task={files['val' + blank]}", f"sft.data={files['train_blank']}", f"trainer.seed={seed}",
            f"trainer.output_dir={out / f'seed{seed}' / run}", "trainer.loggers=[jsonl]"] + \
        (["actor.optim.lr=0"] if run == "lr0" else [])


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def held_out(out: Path, seed: int, run: str) -> dict[int, float]:
    return {r["step"]: r["val/reward"] for r in read(run_metrics(out / f"seed{seed}" / run)) if "val/reward" in r}


def text_only_best(val_file: Path) -> float:
    """The held-out reward of the best policy blind to the image: always the most frequent answer."""
    answers = Counter(json.loads(line)["answer"] for line in val_file.read_text().splitlines())
    return max(answers.values()) / sum(answers.values())


def table(out: Path, seeds: list[int], steps: int) -> tuple[str, dict]:
    lines = ["| run | seed | held-out before RL | after RL | change | text-only best | minutes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    summary = {}
    for run in RUNS:
        changes = []
        for seed in seeds:
            val = held_out(out, seed, run)
            best = text_only_best(out / f"seed{seed}" / "shapes" / "val" / "prompts.jsonl")
            seconds = out / f"seed{seed}" / run / "seconds.txt"
            minutes = f"{float(seconds.read_text()) / 60:.1f}" if seconds.exists() else ""
            if 0 in val and steps in val:
                changes.append(val[steps] - val[0])
                lines.append(f"| {run} | {seed} | {val[0]:.3f} | {val[steps]:.3f} | {changes[-1]:+.3f} | {best:.3f} | "
                             f"{minutes} |")
            summary[f"{run}/seed{seed}"] = {"held_out": val, "text_only_best": best}
        if len(changes) > 1:
            lines.append(f"| {run} | mean | | | {statistics.mean(changes):+.3f} +- {statistics.stdev(changes):.3f} | "
                         "| |")
    return "\n".join(lines), summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=sorted(RECIPES), default="count", help="the shapes task and its recipe")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--out", default="runs/vl_cpu")
    p.add_argument("--table", action="store_true", help="print the table of the runs in --out and exit")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    recipe = RECIPES[args.task]
    steps = tiny_config(args.overrides, path=recipe).trainer.steps
    if not args.table:
        for seed in args.seeds:
            files = prepare(out, seed, args.task)
            for run in args.runs:
                if steps in held_out(out, seed, run):
                    continue
                run_dir = out / f"seed{seed}" / run
                run_dir.mkdir(parents=True, exist_ok=True)
                run_metrics(run_dir).unlink(missing_ok=True)
                start = time.perf_counter()
                with open(run_dir / "run.log", "w") as log:
                    code = subprocess.call([sys.executable, "-m", "megarl.train", "--config", recipe,
                                            *overrides(run, seed, files, out), *args.overrides],
                                           stdout=log, stderr=subprocess.STDOUT)
                (run_dir / "seconds.txt").write_text(f"{time.perf_counter() - start:.0f}\n")
                print(f"seed {seed} {run}: exit {code}, {time.perf_counter() - start:.0f} s", flush=True)
    text, summary = table(out, args.seeds, steps)
    (out / "vl_cpu.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
