"""In-job recovery (trainer.max_restarts, megarl/recovery.py) in the asynchronous modes: the rollout thread is ended,
what was lost replaced, and the newest checkpoint, rollout buffer included, restored; the run completes. one_step_off
on the hf engine replays exactly, so a faulted run equals the uninterrupted one bit for bit; the async mode cannot
(below), so it completes with its steps, its restarts recorded, and nothing of the lost processes left."""

import dataclasses
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray
import torch

from megarl.async_trainer import build_trainer
from megarl.rewards.failures import RewardFailureTracker
from megarl.rewards.scoring import Scores
from megarl.rollout_buffer import RolloutBuffer
from megarl.utils.tracking import run_dir
from megarl.workers.group import WorkerError
from tests.test_async import config as async_config
from tests.test_async import metrics_by_step, numbers

# how many groups were in the buffer at a take: how far the rollout thread had got by then, a race
RACED = ("async/buffer_groups",)


def config(output_dir, steps: int, *overrides):
    # a checkpoint every 2 steps and after the last; evaluated before RL and after the last step alone
    return async_config(output_dir, f"trainer.steps={steps}", "trainer.save_every=2", "trainer.keep_last=2",
                        "trainer.eval_every=0", *overrides)


def rollout_pid(rollout) -> int:
    """The rollout actor's pid, once its process has started (Ray's actor table keeps it after its death)."""
    deadline = time.monotonic() + 60
    while not (pid := ray._private.state.actors(rollout._actor_id.hex()).get("Pid")):
        assert time.monotonic() < deadline, "the rollout actor did not start"
        time.sleep(0.1)
    return pid


def watch_processes(trainer) -> SimpleNamespace:
    """The training ranks' pids and the rollout actors the trainer holds now and starts from now on."""
    seen = SimpleNamespace(ranks={i["pid"] for i in trainer.actor.info}, rollouts=[trainer.rollout])
    start_training, use_rollout = trainer.start_training, trainer.use_rollout

    def started_training():
        start_training()
        seen.ranks.update(i["pid"] for i in trainer.actor.info)

    def used_rollout(rollout):
        use_rollout(rollout)
        seen.rollouts.append(rollout)
    trainer.start_training, trainer.use_rollout = started_training, used_rollout
    return seen


def kill_as_steps_begin(trainer, plan: dict) -> list:
    """SIGKILL, as step N begins (the trainer's step N: its policy version is N - 1), the process plan[N] names (an
    actor rank's index, or "rollout"), once each."""
    step, killed = trainer.step, []

    def step_then_kill():
        target = plan.pop(trainer.version + 1, None)
        if target is not None:
            pid = rollout_pid(trainer.rollout) if target == "rollout" else trainer.actor.info[target]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append((trainer.version + 1, target, pid))
        return step()
    trainer.step = step_then_kill
    return killed


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fit(trainer, seen: SimpleNamespace | None = None) -> SimpleNamespace:
    """fit() to the end: the final weights and held-out rewards; then no rollout thread runs, and none of the
    processes `seen` (watch_processes: the lost ones, those a restart ended, those the shutdown ended) is left."""
    try:
        history = trainer.fit()
        result = SimpleNamespace(weights=trainer.actor.call("hf_state_dict")[0], history=history)
    finally:
        trainer.shutdown()
    assert not [t for t in threading.enumerate() if t.name == "megarl-rollout"]
    if seen is not None:
        pids = seen.ranks | {rollout_pid(r) for r in seen.rollouts}
        deadline = time.monotonic() + 30  # a killed actor's process exits a moment later
        while left := [p for p in pids if alive(p)]:
            assert time.monotonic() < deadline, f"processes left: {left}"
            time.sleep(0.2)
    return result


def restarts(output_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir(output_dir) / "restarts.jsonl").read_text().splitlines()]


def restart_rows(output_dir) -> list[tuple[int, int]]:
    """metrics.jsonl's restart rows: (the step resumed from, the restart's count)."""
    rows = [json.loads(line) for line in (run_dir(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["restart/count"]) for row in rows if "restart/count" in row]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_local) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = fit(build_trainer(config(out, 4, "trainer.mode=one_step_off")))
    result.rows = metrics_by_step(out)
    return result


def test_one_step_off_recovers_a_killed_rank_and_rollout_actor_bitwise(tmp_path, uninterrupted):
    """The actor's rank killed as step 3 begins (restored from step 2 with the buffer that checkpoint holds; the
    rollout thread, which makes batch 4 about then, is ended, the rollout actor stays up, warm), then the rollout
    actor as step 4 begins (restored from step 2 again, step 3 replayed, a new rollout actor): one_step_off generates
    each batch whole from the policy one version back, which the replay recomputes, so the run's metrics and final
    weights equal the uninterrupted run's bit for bit."""
    trainer = build_trainer(config(tmp_path, 4, "trainer.mode=one_step_off"))
    seen = watch_processes(trainer)
    killed = kill_as_steps_begin(trainer, {3: 0, 4: "rollout"})
    result = fit(trainer, seen)

    assert [k[:2] for k in killed] == [(3, 0), (4, "rollout")]
    # replaced once: after the rank's loss it stayed up, and it was the one killed
    assert len(seen.rollouts) == 2 and rollout_pid(seen.rollouts[0]) == killed[1][2]
    rows = restarts(tmp_path)
    assert [(r["failed_step"], r["resumed_from"], r["replayed_steps"]) for r in rows] == [(3, 2, 0), (4, 2, 1)]
    assert rows[0]["cause"].startswith(f"actor rank 0 (pid {killed[0][2]}) died in ")
    assert rows[1]["cause"].startswith("the rollout actor died in ") and rows[1]["cause"].endswith(" during step 4")
    assert restart_rows(tmp_path) == [(2, 1), (2, 2)]

    got = metrics_by_step(tmp_path)
    assert sorted(got) == list(range(5))
    for step in range(1, 5):
        expected = {k: v for k, v in numbers(uninterrupted.rows[step]).items() if k not in RACED}
        differing = {k: (v, got[step].get(k)) for k, v in expected.items() if got[step].get(k) != v}
        assert not differing, (step, differing)
    assert result.history == uninterrupted.history
    for name, weight in uninterrupted.weights.items():
        assert torch.equal(result.weights[name], weight), name


def test_async_replaces_a_hung_rollout_actor(tmp_path, ray_local):
    """trainer.mode=async, async.max_staleness=1: the rollout actor SIGSTOPped as the rollout thread begins batch 5
    (after the trainer's update to version 3; the thread's calls have a 15 s deadline here, the trainer's the default):
    the trainer's step 4 waits on the actor (its update's pause) until the thread's deadline kills it, the hang is
    named as such and the actor replaced, the run restored from step 2. (A lost training rank restarts as in
    one_step_off, above.) Not compared with an uninterrupted run: which policy version a batch is generated from
    depends on whether the rollout thread begins it before or after the trainer's next update (either is within the
    bound), so two runs of this mode differ in their samples, interrupted or not. The run completes all its steps
    within the bound, the restart recorded, and neither the hung actor nor any other process it had is left."""
    trainer = build_trainer(config(tmp_path, 5, "trainer.mode=async", "async.max_staleness=1"))
    sampler = trainer.rollout_sampler
    sampler.cfg = dataclasses.replace(sampler.cfg, trainer=dataclasses.replace(sampler.cfg.trainer,
                                                                              worker_timeout_s=15.0))
    seen, stopped = watch_processes(trainer), []
    sample_batches = sampler.sample_batches

    def stop_then_sample(count):
        if trainer.buffer.begun == 5 and not stopped:
            stopped.append(rollout_pid(trainer.rollout))
            os.kill(stopped[0], signal.SIGSTOP)
        return sample_batches(count)
    sampler.sample_batches = stop_then_sample
    fit(trainer, seen)

    assert stopped and len(seen.rollouts) == 2 and rollout_pid(seen.rollouts[0]) == stopped[0]
    [row] = restarts(tmp_path)
    assert row["lost"] == "the rollout actor"
    assert row["cause"] == "the rollout actor missed its deadline in generate_groups during step 4"
    assert (row["failed_step"], row["resumed_from"], row["replayed_steps"]) == (4, 2, 1)
    assert restart_rows(tmp_path) == [(2, 1)]
    got = metrics_by_step(tmp_path)
    assert sorted(got) == list(range(6)) and all("train/reward" in got[s] for s in range(1, 6))
    assert all(got[s]["async/staleness_max"] <= 1 for s in range(1, 6))


def test_no_checkpoint_of_a_buffer_whose_rollout_thread_failed():
    """A checkpoint's pause between batches raises the error the rollout thread stopped on with a batch begun (the
    buffer's state would count that batch's groups, which never come), and leaves the buffer unpaused."""
    buffer = RolloutBuffer(groups_per_step=1, max_staleness=1, buffer_batches=0, stale="drop", steps=4)
    buffer.begin_batches()
    lost = WorkerError("the rollout actor failed in generate_groups: ActorDiedError")
    buffer.fail(lost)
    with pytest.raises(WorkerError) as raised:
        with buffer.paused_between_batches():
            pytest.fail("a checkpoint was written")
    assert raised.value is lost and not buffer.paused


def test_a_restart_forgets_the_reward_calls_of_a_batch_cut_short():
    """The rollout thread scores each group as it ends: a batch lost midway has calls counted in a step never closed,
    which a restart drops with the steps after the checkpoint (its prompts are scored again)."""
    tracker = RewardFailureTracker(max_rate=0.5, window=4)
    tracker.add(Scores([0.0, 1.0], [object()]))
    assert tracker.end_step(3) == 1
    tracker.add(Scores([0.0, 0.0], [object(), object()]))  # batch 4, cut short by the lost rollout actor
    tracker.forget_after(3)
    tracker.add(Scores([1.0, 1.0], []))  # batch 4 again
    assert tracker.end_step(4) == 0 and [(s.step, s.calls, s.failed) for s in tracker.steps] == [(3, 2, 1), (4, 2, 0)]
