"""VAPO's and PF-PPO's learning runs on CPU, each beside its baseline and a learning-rate-0 control (same seed, same
warm start, same held-out draws):

  vapo    configs/vapo_quickstart.yaml            against PPO with the same critic and none of VAPO's pieces
  pfppo   configs/pfppo_quickstart.yaml (PF-PPO)  against plain GRPO, 20% of the training rewards flipped
                                                  (r -> 1 - r, drawn per sample and step); held out: clean

    python -m benchmarks.algorithms_cpu [--compare vapo pfppo] [--out runs/algorithms_cpu] [key=value ...]
    python -m benchmarks.algorithms_cpu --table --out runs/algorithms_cpu     # the table of finished runs

Each run is `python -m benchmarks.algorithms_cpu --run NAME` in a process of its own (one Ray, one trainer),
one after the other (--runs picks some; a run that fails is tried again, up to 3 times: on a crowded machine
Ray's start can time out); its metrics.jsonl goes to OUT/NAME/. Extra key=value arguments go to every run. The
table printed last: the held-out reward (mean@4) at every evaluation and the mean training reward of the last
10 steps of each run; OUT/summary.json holds both curves of every run. Not part of the test suite: minutes per
run on two cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megarl.utils.tracking import run_metrics

VAPO_OFF = ["algorithm.gae.critic_warmup_steps=0", "algorithm.gae.critic_lam=-1", "algorithm.gae.lam_length_alpha=0",
            "algorithm.positive_lm.coef=0", "algorithm.clip_eps_high=0"]
GRPO = ["algorithm.pf_ppo.method=none", "algorithm.pf_ppo.replay=0"]
NOISE = 0.2  # share of the training rewards flipped in the pfppo comparison

# name -> (recipe, overrides, reward noise)
RUNS = {
    "vapo": ("configs/vapo_quickstart.yaml", [], 0.0),
    "ppo_critic": ("configs/vapo_quickstart.yaml", VAPO_OFF, 0.0),
    "vapo_lr0": ("configs/vapo_quickstart.yaml", ["actor.optim.lr=0"], 0.0),
    "pfppo_noisy": ("configs/pfppo_quickstart.yaml", [], NOISE),
    "grpo_noisy": ("configs/pfppo_quickstart.yaml", GRPO, NOISE),
    "pfppo_noisy_lr0": ("configs/pfppo_quickstart.yaml", ["actor.optim.lr=0"], NOISE),
}
COMPARISONS = {"vapo": ["vapo", "ppo_critic", "vapo_lr0"], "pfppo": ["pfppo_noisy", "grpo_noisy", "pfppo_noisy_lr0"]}


def noisy_trainer(noise: float):
    """An RLTrainer whose training rewards (not the held-out ones) are flipped, r -> 1 - r, for a share `noise`
    of the samples, drawn from (trainer.seed, policy version, batch size): the same flips in every run."""
    import torch

    from megarl.rollout.base import derive_seed
    from megarl.trainer import RLTrainer

    class NoisyRewards(RLTrainer):
        def score(self, batch, evaluation=False):
            batch = super().score(batch, evaluation)
            if not evaluation and noise > 0:
                g = torch.Generator().manual_seed(derive_seed(self.cfg.trainer.seed, self.version, "flip", len(batch)))
                flipped = torch.rand(len(batch), generator=g) < noise
                batch["rewards"] = torch.where(flipped, 1 - batch["rewards"], batch["rewards"])
            return batch

    return NoisyRewards


def run_one(name: str, out: Path, extra: list[str]) -> None:
    from megarl.config.tiny import tiny_config
    from megarl.train import start_ray

    recipe, overrides, noise = RUNS[name]
    cfg = tiny_config(overrides + [f"trainer.output_dir={out / name}", "trainer.loggers=[jsonl]"] + extra, path=recipe)
    ray = start_ray(cfg, cfg.actor.parallel.world_size * cfg.trainer.cpus_per_rank + cfg.rollout.num_cpus)
    trainer = noisy_trainer(noise)(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
        ray.shutdown()


def read(out: Path, name: str) -> list[dict]:
    path = run_metrics(out / name)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(out: Path, names: list[str]) -> dict:
    """Per run: the held-out reward by step and the training reward of every step."""
    return {name: {"val_reward": {r["step"]: r["val/reward"] for r in read(out, name) if "val/reward" in r},
                   "train_reward": [r["train/reward"] for r in read(out, name) if "train/reward" in r]}
            for name in names}


def table(out: Path, names: list[str]) -> str:
    """Markdown: per run, the held-out reward at each evaluation step and the last 10 steps' training reward."""
    rows = {name: read(out, name) for name in names}
    steps = sorted({r["step"] for rs in rows.values() for r in rs if "val/reward" in r})
    lines = ["| run | " + " | ".join(f"val@{s}" for s in steps) + " | train reward, last 10 steps | minutes |",
             "| --- |" + " --- |" * (len(steps) + 2)]
    for name, records in rows.items():
        val = {r["step"]: r["val/reward"] for r in records if "val/reward" in r}
        train = [r["train/reward"] for r in records if "train/reward" in r][-10:]
        seconds = (out / name / "seconds.txt").read_text().strip() if (out / name / "seconds.txt").exists() else ""
        cells = [f"{val[s]:.3f}" if s in val else "" for s in steps]
        mean = f"{sum(train) / len(train):.3f}" if train else ""
        minutes = f"{float(seconds) / 60:.1f}" if seconds else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} | {minutes} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare", nargs="+", choices=sorted(COMPARISONS), default=sorted(COMPARISONS))
    p.add_argument("--run", choices=sorted(RUNS), help="one run, in this process")
    p.add_argument("--runs", nargs="+", choices=sorted(RUNS), help="these runs only (default: --compare's)")
    p.add_argument("--out", default="runs/algorithms_cpu")
    p.add_argument("--table", action="store_true", help="print the table of the runs in --out and exit")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    names = args.runs or [n for c in args.compare for n in COMPARISONS[c]]
    if args.run:
        run_one(args.run, out, args.overrides)
        return 0
    if not args.table:
        for name in names:
            for _ in range(3):
                shutil.rmtree(out / name, ignore_errors=True)
                (out / name).mkdir(parents=True)
                start = time.perf_counter()
                with open(out / name / "run.log", "w") as log:
                    code = subprocess.call([sys.executable, "-m", "benchmarks.algorithms_cpu", "--run", name, "--out",
                                            str(out), *args.overrides], stdout=log, stderr=subprocess.STDOUT)
                if code == 0:
                    break
            (out / name / "seconds.txt").write_text(f"{time.perf_counter() - start:.0f}\n")
            print(f"{name}: exit {code}, {time.perf_counter() - start:.0f} s", flush=True)
    (out / "summary.json").write_text(json.dumps(summary(out, names), indent=1))
    print(table(out, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
