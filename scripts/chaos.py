"""Many faults in one long CPU run: in-job recovery (trainer.max_restarts) against the uninterrupted run.

    python scripts/chaos.py --steps 60 --save-every 5 --faults 6 --seed 0 --out docs/results/chaos_cpu.json

Runs the tiny recipe (configs/quickstart.yaml: TP=2 on two gloo ranks, the hf engine) twice in one local Ray: once
without faults, once with `--faults` SIGKILLs, each of a target drawn by a seeded generator (actor rank 0, rank 1 or
the rollout actor) at a time drawn from it too (a step chosen among those left, then a delay into that step), so that
processes die in generation, in training calls, in weight syncs and in checkpoint writes. The faulted run must finish,
and its metrics (every logged number but wall-clock readings) and final weights must equal the uninterrupted run's,
bit for bit. Writes one JSON: the settings, each restart's record (restarts.jsonl: cause, step, steps replayed,
seconds lost), whether the runs agree, and the wall time of each. Exit status 1 when they do not agree.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megarl.config.tiny import tiny_config  # noqa: E402
from megarl.trainer import RLTrainer  # noqa: E402
from megarl.utils.tracking import run_dir  # noqa: E402

CLOCK = ("timing/", "perf/", "sync/seconds", "sync/gb_per_s", "restart/")


def config(out: Path, args) -> object:
    return tiny_config([f"trainer.output_dir={out}", f"trainer.steps={args.steps}",
                        f"trainer.save_every={args.save_every}", f"trainer.max_restarts={args.faults}",
                        "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8", "rollout.eval_n_samples=2",
                        "sft.steps=2", "sft.batch_size=8", "trainer.eval_every=0", "trainer.loggers=jsonl"],
                       path=REPO / "configs" / "quickstart.yaml")


def rows(out: Path) -> dict:
    found = {}
    for line in (run_dir(out) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/reward" in row:
            found[row["step"]] = {k: v for k, v in row.items() if not k.startswith(CLOCK)
                                  and not (k.startswith("sync/") and k.endswith("_s"))}
    return found


def pid_of(trainer, target) -> int:
    if target == "rollout":
        return ray._private.state.actors(trainer.rollout._actor_id.hex())["Pid"]
    return trainer.actor.info[target]["pid"]


def fit(trainer, plan: dict | None = None, killed: list | None = None) -> tuple[dict, float]:
    """fit() to the end; plan: step -> (target, delay in s after the step begins), each fault fired once and recorded
    in `killed`."""
    step = trainer.step

    def step_then_kill():
        fault = (plan or {}).pop(trainer.version + 1, None)
        if fault is not None:
            target, delay = fault
            pid = pid_of(trainer, target)  # this generation's process: a restart meanwhile leaves nothing to kill

            def kill():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append({"step": trainer.version + 1, "target": target, "pid": pid, "delay_s": delay})
                except ProcessLookupError:
                    pass

            threading.Timer(delay, kill).start()
        return step()

    trainer.step = step_then_kill
    start = time.perf_counter()
    try:
        trainer.fit()
        return trainer.actor.call("hf_state_dict")[0], time.perf_counter() - start
    finally:
        trainer.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay-s", type=float, default=6.0, help="the latest a fault fires into its step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    chance = random.Random(args.seed)
    steps = sorted(chance.sample(range(2, args.steps + 1), args.faults))
    plan = {s: (chance.choice([0, 1, "rollout"]), round(chance.uniform(0, args.max_delay_s), 2)) for s in steps}
    planned = {s: list(f) for s, f in plan.items()}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    with tempfile.TemporaryDirectory() as tmp:
        whole, whole_s = fit(RLTrainer(config(Path(tmp) / "whole", args)))
        killed, stopped = [], None
        try:
            faulted, faulted_s = fit(RLTrainer(config(Path(tmp) / "chaos", args)), plan, killed)
        except Exception as error:  # a fault it did not recover from (during a restart, past the limit): recorded
            faulted, faulted_s, stopped = {}, float("nan"), f"{type(error).__name__}: {error}"[:2000]
        expected, got = rows(Path(tmp) / "whole"), rows(Path(tmp) / "chaos")
        restarts = [json.loads(line) for line in
                    (run_dir(Path(tmp) / "chaos") / "restarts.jsonl").read_text().splitlines()] \
            if (run_dir(Path(tmp) / "chaos") / "restarts.jsonl").exists() else []
    differing = sorted(f"{s}:{k}" for s, row in expected.items() for k, v in row.items()
                       if got.get(s, {}).get(k) != v)
    weights_equal = whole.keys() == faulted.keys() and all(torch.equal(whole[k], faulted[k]) for k in whole)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"what": "in-job recovery under SIGKILLs (scripts/chaos.py)", "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "host": f"CPU, {os.cpu_count()} cores",
              "load_average": os.getloadavg(), "settings": vars(args), "planned": planned, "killed": killed,
              "restarts": restarts, "stopped": stopped,
              "steps_equal": sorted(got) == sorted(expected) and not differing,
              "differing": differing[:20], "weights_equal": weights_equal,
              "uninterrupted_s": whole_s, "faulted_s": faulted_s,
              "recovery_s": [r["recovery_s"] for r in restarts], "seconds_lost": [r["seconds_lost"] for r in restarts]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(killed)} kills, {len(restarts)} restarts; metrics equal: {result['steps_equal']}; weights equal: "
          f"{weights_equal}; recovery_s {[round(r, 1) for r in result['recovery_s']]}; "
          f"run {whole_s:.0f} s uninterrupted, {faulted_s:.0f} s with faults")
    return 0 if result["steps_equal"] and weights_equal else 1


if __name__ == "__main__":
    sys.exit(main())
