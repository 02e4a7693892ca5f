"""The driver's wait on the training ranks: it fails fast, names the rank and the call, and has a deadline."""

import os
import re
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray

from megarl.config.tiny import tiny_config
from megarl.workers.group import (TrainGroup, WorkerError, WorkerTimeout, call_rollout, get_all, stop_ranks,
                                  stop_rollout, stream_rollout)
from tests.conftest import QUICKSTART
from tests.engine.hf_models import make_qwen2_dir, padded_batch


@ray.remote
class Rank:
    def step(self, fail: bool, wait: float = 0.0) -> str:
        if fail:
            raise RuntimeError("rank failed: server died mid-sync")
        time.sleep(wait)  # a rank waiting in a collective on the failed one
        return "done"

    def die(self) -> None:
        os._exit(1)

    def pid(self) -> int:
        return os.getpid()

    def items(self, count: int):
        for item in range(count):  # Ray send()s into it: `yield from range(...)` has no send
            yield item

    def shutdown(self) -> None:
        pass


def test_get_all_fails_as_soon_as_one_rank_fails_while_others_still_wait(ray_local):
    ranks = [Rank.remote() for _ in range(3)]
    assert get_all([r.step.remote(False) for r in ranks]) == ["done"] * 3
    start = time.monotonic()
    with pytest.raises(WorkerError, match="(?s)rank 1 failed in step: .*server died mid-sync"):
        get_all([ranks[0].step.remote(False, 60), ranks[1].step.remote(True), ranks[2].step.remote(False, 60)],
                "step", "rank {}".format)
    assert time.monotonic() - start < 30
    for r in ranks:
        ray.kill(r)
    ranks = [Rank.remote() for _ in range(2)]
    with pytest.raises(WorkerError, match="(?s)rank 1 failed in die: .*actor died"):  # died outright: named too
        get_all([ranks[0].step.remote(False, 60), ranks[1].die.remote()], "die", "rank {}".format)
    assert time.monotonic() - start < 60
    ray.kill(ranks[0])


def test_stop_ranks_kills_a_rank_stuck_after_a_failure(ray_local):
    ranks = [Rank.remote() for _ in range(2)]
    stuck = ranks[1].step.remote(False, 600)  # still in a collective with a rank that failed
    start = time.monotonic()
    stop_ranks(ranks, timeout=3)
    assert time.monotonic() - start < 20
    with pytest.raises(ray.exceptions.RayActorError):  # killed, not left running
        ray.get(stuck, timeout=20)


def test_a_rollout_call_past_its_deadline_names_the_call_and_kills_the_actor(ray_local):
    rollout = Rank.remote()
    assert call_rollout(rollout, "step", False, timeout=30) == "done"
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"the rollout actor \(pid \d+, sleeping\) did not answer step within 1 s "
                                           r"\(trainer.worker_timeout_s\); killed it"):
        call_rollout(rollout, "step", False, 600, timeout=1)
    assert time.monotonic() - start < 20
    with pytest.raises(ray.exceptions.RayActorError):  # killed: a shutdown call would have queued for 600 s
        ray.get(rollout.step.remote(False), timeout=30)


def test_a_stopped_rollout_actor_is_a_hang_for_every_call_waiting_on_it(ray_local):
    """The asynchronous modes' two waiters on the rollout actor: the rollout thread's stream and the trainer's calls.
    The deadline of one kills the SIGSTOPped actor; the other's call then reports that hang, not the death."""
    rollout = Rank.remote()
    assert list(stream_rollout(rollout, "items", 3, timeout=30)) == [0, 1, 2]
    pid = ray.get(rollout.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    hang = (rf"the rollout actor \(pid {pid}, stopped\) did not answer items within 2 s "
            r"\(trainer.worker_timeout_s\); killed it \(and so its servers\)")
    trainer_call = {}

    def trainer_waits() -> None:  # the trainer's pause_generation, with the run's deadline (longer than the stream's)
        try:
            call_rollout(rollout, "step", False, timeout=60)
        except WorkerError as error:
            trainer_call["error"] = error

    trainer = threading.Thread(target=trainer_waits)
    trainer.start()
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=hang):
        list(stream_rollout(rollout, "items", 3, timeout=2))
    trainer.join(timeout=30)
    assert time.monotonic() - start < 30
    assert isinstance(trainer_call["error"], WorkerTimeout)
    assert re.fullmatch(hang + r" \(the call step ended with it\)", str(trainer_call["error"]))
    start = time.monotonic()
    stop_rollout(rollout)  # killed already: no shutdown call queued behind the hang
    assert time.monotonic() - start < 5


def test_a_weight_sync_past_its_deadline_names_the_rollout_actor_it_sends_to_and_kills_it(ray_local):
    """The training ranks wait on the rollout actor inside push_weights: a stopped actor leaves them sleeping, and the
    error names it beside them, with its state."""
    from megarl.trainer import RLTrainer

    class RanksFailed:  # a sync that failed on the ranks' side
        def call(self, method, *args):
            raise WorkerError(f"actor rank 0 failed in {method}: ray::TrainWorker.push_weights() ... actor died")

    rollout = Rank.remote()
    with pytest.raises(WorkerError) as error:  # the rollout actor healthy: the ranks' own error, as it was
        RLTrainer.sync_weights(SimpleNamespace(actor=RanksFailed(), rollout=rollout, cfg=tiny_config(), syncs=0))
    assert type(error.value) is WorkerError and str(error.value).startswith("actor rank 0 failed in push_weights")
    pid = ray.get(rollout.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    ranks_missed = "actor rank 0 (pid 1, sleeping) did not answer push_weights within 1 s (trainer.worker_timeout_s)"

    class Ranks:  # the policy's TrainGroup, past its deadline
        def call(self, method, *args):
            raise WorkerTimeout(f"{ranks_missed}; killed all 1 actor ranks")

    trainer = SimpleNamespace(actor=Ranks(), rollout=rollout, cfg=tiny_config(), syncs=0)
    with pytest.raises(WorkerTimeout) as error:
        RLTrainer.sync_weights(trainer)
    assert str(error.value) == (f"{ranks_missed}; killed all 1 actor ranks; the rollout actor (pid {pid}, stopped) was "
                                "receiving their weights (push_weights); killed it (and so its servers)")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(rollout.pid.remote(), timeout=30)

    with pytest.raises(WorkerTimeout) as error:  # its rollout actor killed for its hang meanwhile (another deadline)
        RLTrainer.sync_weights(SimpleNamespace(actor=RanksFailed(), rollout=rollout, cfg=tiny_config(), syncs=0))
    assert str(error.value) == (f"the rollout actor (pid {pid}, stopped) was receiving their weights (push_weights); "
                                "killed it (and so its servers) (the training ranks' push_weights ended with it)")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by Ray
    except psutil.NoSuchProcess:
        return True


def test_a_stopped_rank_fails_the_call_at_its_deadline_naming_it_and_every_rank_is_killed(tmp_path, ray_local):
    cfg = tiny_config([f"trainer.output_dir={tmp_path}", "actor.parallel.tp=1",
                                   "trainer.worker_env={MEGARL_ENV_PROBE: 7, MEGARL_FLAG: true}"], path=QUICKSTART)
    model = make_qwen2_dir(tmp_path / "model", tied=False, layers=1)
    group = TrainGroup(cfg, model, "cpu", total_steps=1)  # DP=2: train all-reduces across the two
    pids = [info["pid"] for info in group.info]
    for pid in pids:  # trainer.worker_env reached every rank
        assert {k: psutil.Process(pid).environ().get(k) for k in ("MEGARL_ENV_PROBE", "MEGARL_FLAG")} == \
            {"MEGARL_ENV_PROBE": "7", "MEGARL_FLAG": "1"}
    group.timeout = 3.0  # trainer.worker_timeout_s, short for the test (set-up had the default)
    os.kill(pids[1], signal.SIGSTOP)
    batch = padded_batch(rows=4)
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"actor rank 0 \(pid \d+, sleeping\), actor rank 1 \(pid \d+, stopped\) "
                                           r"did not answer train within 3 s \(trainer.worker_timeout_s\); killed all 2"):
        group.train(batch, loss="sft")
    assert time.monotonic() - start < 20
    deadline = time.monotonic() + 30
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(map(_gone, pids))
    group.shutdown()  # the placement group; the killed ranks are not waited for
