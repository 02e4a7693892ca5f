"""In-job recovery (trainer.max_restarts, megarl/recovery.py): a run whose training ranks and rollout actor are
SIGKILLed goes on from its newest checkpoint, and its metrics and final weights equal those of the run that was never
interrupted, bit for bit; a fault that comes back past the limit stops the run naming it."""

import json
import os
import random
import signal
from types import SimpleNamespace

import pytest
import ray
import torch

from megarl import recovery as recovery_module
from megarl.recovery import Recovery, RestartLimit
from megarl.resume import plan_resume
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from megarl.workers import group as group_module
from megarl.workers.group import WorkerError
from tests.engine.test_checkpoint_trainer import config as checkpoint_config
from tests.engine.test_checkpoint_trainer import metric_rows

STEPS = 8


def config(tmp_path, *overrides):
    # a checkpoint every 2 steps; evaluated before RL and after the last step alone
    return checkpoint_config(tmp_path, f"trainer.steps={STEPS}", "trainer.save_every=2", "trainer.keep_last=2",
                             "trainer.eval_every=0", *overrides)


def rollout_pid(trainer) -> int:
    return ray._private.state.actors(trainer.rollout._actor_id.hex())["Pid"]


def kill_at_steps(trainer, plan: dict) -> list:
    """SIGKILL, as step N begins, the process plan[N] names (an actor rank's index, or "rollout"), once each; the step
    in progress is kept in trainer.step_in_progress."""
    step, killed = trainer.step, []
    trainer.step_in_progress = 0  # (the warm start's calls)

    def step_then_kill():
        trainer.step_in_progress = trainer.version + 1  # (sync: the policy version is the steps completed)
        target = plan.pop(trainer.step_in_progress, None)
        if target is not None:
            pid = rollout_pid(trainer) if target == "rollout" else trainer.actor.info[target]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append((trainer.version + 1, target, pid))
        return step()

    trainer.step = step_then_kill
    return killed


def fit(trainer) -> SimpleNamespace:
    try:
        history = trainer.fit()
        return SimpleNamespace(weights=trainer.actor.call("hf_state_dict")[0], history=history)
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_local) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = fit(RLTrainer(config(out)))
    result.rows = metric_rows(out, 0)
    return result


def test_killed_ranks_and_rollout_actor_are_replaced_and_the_run_equals_the_uninterrupted_one(
        tmp_path, uninterrupted, monkeypatch):
    """Three faults in one run: actor rank 1 killed as step 4 begins (restored from step 2: step 3 replayed), the
    rollout actor as step 6 begins (from step 4), and an actor rank inside a training-rank call chosen at random (a
    fixed seed) among those of steps 7-8."""
    trainer = RLTrainer(config(tmp_path))
    killed = kill_at_steps(trainer, {4: 1, 6: "rollout"})
    chance = random.Random(46)
    chosen = {"call": chance.randrange(0, 6), "rank": chance.randrange(0, 2)}
    get_all, calls = group_module.get_all, []

    def get_all_killing(refs, call="the call", describe=None, timeout=0.0):
        # the policy's ranks busy in `call` (their refs submitted): the chosen rank dies inside it
        policy = getattr(describe, "__self__", None) is trainer.actor
        if policy and trainer.step_in_progress >= 7 and len(killed) == 2:
            calls.append(call)
            if len(calls) - 1 == chosen["call"]:
                pid = trainer.actor.info[chosen["rank"]]["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append((trainer.step_in_progress, call, pid))
        return get_all(refs, call, describe, timeout) if describe else get_all(refs, call)

    monkeypatch.setattr(group_module, "get_all", get_all_killing)
    result = fit(trainer)

    assert [k[:2] for k in killed[:2]] == [(4, 1), (6, "rollout")] and len(killed) == 3, killed
    restarts = [json.loads(line) for line in (run_dir(tmp_path) / "restarts.jsonl").read_text().splitlines()]
    assert [(r["failed_step"], r["resumed_from"], r["replayed_steps"]) for r in restarts[:2]] == [(4, 2, 1), (6, 4, 1)]
    assert restarts[0]["cause"].startswith(f"actor rank 1 (pid {killed[0][2]}) died in ")
    assert restarts[0]["cause"].endswith(" during step 4")
    assert restarts[1]["cause"].startswith("the rollout actor died in generate")
    third = restarts[2]
    assert third["failed_step"] == killed[2][0] and third["resumed_from"] == 6 and third["lost"].startswith(
        f"actor rank {chosen['rank']} (pid {killed[2][2]})")
    assert all(r["seconds_lost"] == r["lost_s"] + r["recovery_s"] > 0 for r in restarts)
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["restart/count"]) for r in rows if "restart/count" in r] == [(2, 1), (4, 2), (6, 3)]

    got = metric_rows(tmp_path, 0)
    assert sorted(got) == list(range(1, STEPS + 1))  # each step once: the replayed ones replaced their rows
    differing = {(step, key): (got[step].get(key), value) for step, row in uninterrupted.rows.items()
                 for key, value in row.items() if got[step].get(key) != value}
    assert not differing and got == uninterrupted.rows, differing
    assert result.history == uninterrupted.history
    assert result.weights.keys() == uninterrupted.weights.keys()
    for name, weight in uninterrupted.weights.items():
        assert torch.equal(result.weights[name], weight), name


@ray.remote(num_cpus=0)
class Process:
    def pid(self) -> int:
        return os.getpid()


def recovery_of(tmp_path, *overrides) -> tuple[Recovery, list]:
    """A Recovery over a trainer of two stand-in actor ranks and a stand-in rollout actor (live Ray actors)."""
    cfg = config(tmp_path, *overrides)
    ranks = [Process.remote() for _ in range(2)]
    pids = ray.get([r.pid.remote() for r in ranks])
    actor = SimpleNamespace(role="actor", workers=ranks, info=[{"pid": p} for p in pids], killed=False)
    trainer = SimpleNamespace(cfg=cfg, start=plan_resume(cfg), actor=actor, critic=None, reward_model=None,
                              rollout=Process.remote())
    return Recovery(trainer), ranks + [trainer.rollout]


def failing(recovery: Recovery, step: int, error: WorkerError) -> BaseException:
    with pytest.raises(WorkerError) as raised:
        with recovery.attempt(step):
            raise error
    return raised.value


def test_what_stops_the_run_instead_of_a_restart(tmp_path, ray_local, monkeypatch):
    """An error from live ranks (a bug, a NaN: a replay would repeat it), a lost rank with trainer.max_restarts=0, one
    before the run's first checkpoint, and a lost rank past the limit (its message naming it and the earlier
    restarts)."""
    error = WorkerError("actor rank 1 (pid 7, running) failed in train: ValueError: non-finite loss")
    recovery, processes = recovery_of(tmp_path)
    # every process alive: as it was, once Ray has had DEATH_NOTICE_S to report a death (none comes: it is waited out)
    monkeypatch.setattr(recovery_module, "DEATH_NOTICE_S", 0.2)
    assert failing(recovery, 3, error) is error
    # a death is seen as soon as Ray reports it: a deadline that a loaded machine cannot miss costs nothing
    monkeypatch.setattr(recovery_module, "DEATH_NOTICE_S", 60.0)
    ray.kill(processes[1])
    pid = recovery.trainer.actor.info[1]["pid"]
    died = WorkerError("actor rank 0 (pid 6, sleeping) failed in train: RuntimeError: Connection closed by peer")
    assert failing(Recovery(SimpleNamespace(**vars(recovery.trainer) | {
        "cfg": config(tmp_path, "trainer.max_restarts=0")})), 3, died) is died
    stopped = failing(recovery, 3, died)  # no checkpoint written yet, none resumed
    assert type(stopped) is RestartLimit and str(stopped) == (
        f"actor rank 1 (pid {pid}) died in train during step 3, before the run's first checkpoint "
        "(trainer.save_every=2): nothing to restart from")
    recovery.restarts = [{"restart": n, "cause": f"the rollout actor died in generate during step {n + 4}"}
                         for n in (1, 2, 3)]
    stopped = failing(recovery, 9, died)
    assert type(stopped) is RestartLimit and stopped.__cause__ is died and str(stopped) == (
        f"actor rank 1 (pid {pid}) died in train during step 9, after 3 restart(s) (trainer.max_restarts=3): stopping. "
        "Earlier: restart 1: the rollout actor died in generate during step 5; restart 2: the rollout actor died in "
        "generate during step 6; restart 3: the rollout actor died in generate during step 7")
    for process in processes:
        ray.kill(process)
