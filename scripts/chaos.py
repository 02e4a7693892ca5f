"""Many faults in long CPU runs: in-job recovery (trainer.max_restarts) against the uninterrupted run.

    python scripts/chaos.py --steps 60 --save-every 5 --rounds 3 --faults 6 --seed 0 --out docs/results/chaos.md

Runs the tiny recipe (configs/quickstart.yaml: TP=2 on two gloo ranks, the hf engine) once without faults, then
`--rounds` times with `--faults` faults each, all in one local Ray. A fault is a signal, SIGKILL (a crash) or SIGSTOP
(a hang, which trainer.worker_timeout_s=`--worker-timeout-s` turns into a kill), sent to a target, actor rank 0, rank
1 or the rollout actor, at a time: a step among those after the first checkpoint, then a delay into it. All three are
drawn by one generator seeded with `--seed`, so a command draws the same faults. A fault waits for the previous one to
be recovered from (one restart each) before it is armed at a step's beginning: a fault during a restart stops the run
by design (docs/failure-modes.md), and this run measures recovery from one fault at a time. A planned fault whose step
was reached with an earlier fault outstanding fires at a later step's beginning; one still waiting when the run ends
never fires, and is listed as such.

Every faulted run must finish, and its metrics (every logged number but wall-clock readings) and final weights must
equal the uninterrupted run's, bit for bit. Writes one markdown file: the command, date, commit and machine at its
top, then a table of the faults (round, step, kind, target, delay, the restart's cause, steps replayed, seconds lost:
from the restored checkpoint's commit to the fault's detection, plus the restart itself) and one of the rounds (wall
time against the uninterrupted run's, equality). Exit status 1 when a round did not finish or does not agree.
"""

import argparse
import json
import os
import random
import shlex
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
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def config(out: Path, args) -> object:
    return tiny_config([f"trainer.output_dir={out}", f"trainer.steps={args.steps}",
                        f"trainer.save_every={args.save_every}", f"trainer.max_restarts={args.faults}",
                        f"trainer.worker_timeout_s={args.worker_timeout_s}",
                        "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8", "rollout.eval_n_samples=2",
                        "sft.steps=2", "sft.batch_size=8", "trainer.eval_every=0", "trainer.loggers=jsonl"],
                       path=REPO / "configs" / "quickstart.yaml")


def draw_plan(chance: random.Random, args) -> list[dict]:
    """--faults faults in distinct steps after the first checkpoint (before it there is nothing to restart from)."""
    steps = sorted(chance.sample(range(args.save_every + 1, args.steps + 1), args.faults))
    return [{"step": s, "kind": chance.choice(args.kinds), "target": chance.choice([0, 1, "rollout"]),
             "delay_s": round(chance.uniform(0, args.max_delay_s), 2)} for s in steps]


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


def fit(trainer, plan: list[dict] = ()) -> tuple[dict, float]:
    """fit() to the end; the faults of `plan` (in order) each armed as a step begins, at its planned step or later,
    once every earlier one has been sent and recovered from; a fault sent gets its `fired_step` and `pid`. Returns
    the final weights and the wall time."""
    step, waiting, timers, fired = trainer.step, list(plan), [], []

    def step_then_fault():
        settled = len(trainer.recovery.restarts) == len(fired) and not any(t.is_alive() for t in timers)
        if waiting and settled and trainer.version + 1 >= waiting[0]["step"]:
            fault = waiting.pop(0)
            pid = pid_of(trainer, fault["target"])  # this generation's process: a restart meanwhile leaves none

            def send():
                try:
                    os.kill(pid, SIGNALS[fault["kind"]])
                    fault.update(fired_step=trainer.version + 1, pid=pid)
                    fired.append(fault)
                except ProcessLookupError:
                    pass

            timers.append(threading.Timer(fault["delay_s"], send))
            timers[-1].start()
        return step()

    trainer.step = step_then_fault
    start = time.perf_counter()
    try:
        trainer.fit()
        for timer in timers:  # a fault not sent by the end of the run is not sent after it
            timer.cancel()
        return trainer.actor.call("hf_state_dict")[0], time.perf_counter() - start
    finally:
        trainer.shutdown()


def faulted_round(number: int, plan: list[dict], whole: dict, expected: dict, tmp: Path, args) -> tuple[dict, list]:
    """One faulted run against the uninterrupted one: the round's summary and its faults with their restarts."""
    out, stopped = tmp / f"round{number}", None
    try:
        weights, wall_s = fit(RLTrainer(config(out, args)), plan)
    except Exception as error:  # a fault it did not recover from (during a restart, past the limit): recorded
        weights, wall_s, stopped = {}, float("nan"), f"{type(error).__name__}: {error}"[:500]
    log = run_dir(out) / "restarts.jsonl"
    restarts = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    got = rows(out) if (run_dir(out) / "metrics.jsonl").exists() else {}
    differing = sorted(f"{s}:{k}" for s, row in expected.items() for k, v in row.items() if got.get(s, {}).get(k) != v)
    weights_equal = whole.keys() == weights.keys() and all(torch.equal(whole[k], weights[k]) for k in whole)
    fired = [f for f in plan if "fired_step" in f]
    # one restart per fault sent, in order: each fault is armed once the one before was recovered from
    faults = [f | {"round": number, "restart": restarts[i] if i < len(restarts) else None}
              for i, f in enumerate(fired)]
    faults += [f | {"round": number, "restart": None, "fired_step": None} for f in plan if "fired_step" not in f]
    summary = {"round": number, "planned": len(plan), "fired": len(fired), "restarts": len(restarts),
               "completed": stopped is None, "stopped": stopped, "wall_s": wall_s,
               "metrics_equal": stopped is None and sorted(got) == sorted(expected) and not differing,
               "differing": differing[:10], "weights_equal": weights_equal}
    print(f"round {number}: {len(fired)} faults sent, {len(restarts)} restarts, completed {stopped is None}, metrics "
          f"equal {summary['metrics_equal']}, weights equal {weights_equal}, {wall_s:.0f} s", flush=True)
    return summary, faults


def report(args, argv: list[str], whole_s: float, rounds: list[dict], faults: list[dict]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["# In-job recovery under faults on the CPU (scripts/chaos.py)", "",
             f"Command: `{shlex.join(['python', 'scripts/chaos.py', *argv])}`  ",
             f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}; commit {commit}; CPU, {os.cpu_count()} cores, load average "
             f"at the end {load} (other work beside it: seconds lost include waiting for the CPU).", "",
             f"The tiny recipe, {args.steps} steps, a checkpoint every {args.save_every}, "
             f"trainer.worker_timeout_s={args.worker_timeout_s:g} (a stopped process is found by that deadline). "
             f"Uninterrupted run: {whole_s:.1f} s.", "",
             "| round | fault | planned step | fired in step | kind | target | delay s | restart cause | resumed from "
             "| replayed steps | lost s | recovery s | seconds lost |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, f in enumerate(faults, 1):
        r = f["restart"]
        restart = ([r["cause"].replace("|", "\\|"), r["resumed_from"], r["replayed_steps"], f"{r['lost_s']:.1f}",
                    f"{r['recovery_s']:.1f}", f"{r['seconds_lost']:.1f}"] if r else
                   ["never sent (the run ended first)" if f["fired_step"] is None else "no restart"] + ["-"] * 5)
        target = "rollout actor" if f["target"] == "rollout" else f"actor rank {f['target']}"
        cells = [f["round"], i, f["step"], f["fired_step"] or "-", f"SIG{f['kind'].upper()}", target, f["delay_s"],
                 *restart]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "| round | faults planned | faults sent | restarts | completed | wall s | extra wall s "
              "| metrics equal | weights equal |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rounds:
        lines.append(f"| {r['round']} | {r['planned']} | {r['fired']} | {r['restarts']} | {r['completed']} | "
                     f"{r['wall_s']:.1f} | {r['wall_s'] - whole_s:.1f} | {r['metrics_equal']} | {r['weights_equal']} |")
    for r in rounds:
        if r["stopped"] or r["differing"]:
            lines += ["", f"Round {r['round']}: stopped: {r['stopped']}; differing: {', '.join(r['differing'])}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="faulted runs, each against the uninterrupted one")
    parser.add_argument("--faults", type=int, default=6, help="faults planned in each round")
    parser.add_argument("--kinds", default="kill,stop", help="the signals drawn from: kill (SIGKILL), stop (SIGSTOP)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay-s", type=float, default=6.0, help="the latest a fault fires into its step")
    parser.add_argument("--worker-timeout-s", type=float, default=60.0,
                        help="trainer.worker_timeout_s: above a new rank's start on a loaded machine")
    parser.add_argument("--out", required=True, help="the markdown file written")
    args = parser.parse_args(argv)
    args.kinds = args.kinds.split(",")
    if unknown := set(args.kinds) - set(SIGNALS):
        parser.error(f"--kinds: {', '.join(sorted(unknown))}: kill or stop")
    if args.faults > args.steps - args.save_every:
        parser.error(f"--faults {args.faults}: at most --steps - --save-every, one a step after the first checkpoint")
    chance = random.Random(args.seed)
    plans = [draw_plan(chance, args) for _ in range(args.rounds)]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    rounds, faults = [], []
    with tempfile.TemporaryDirectory() as tmp:
        whole, whole_s = fit(RLTrainer(config(Path(tmp) / "whole", args)))
        expected = rows(Path(tmp) / "whole")
        print(f"uninterrupted: {whole_s:.0f} s", flush=True)
        for number, plan in enumerate(plans, 1):
            summary, round_faults = faulted_round(number, plan, whole, expected, Path(tmp), args)
            rounds.append(summary)
            faults += round_faults
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report(args, argv, whole_s, rounds, faults))
    print(f"written: {args.out}")
    return 0 if all(r["completed"] and r["metrics_equal"] and r["weights_equal"] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
