"""The driver's wait on the training ranks: it fails fast, names the rank and the call, and has a deadline."""

import os
import signal
import time

import psutil
import pytest
import ray

from megarl.config.tiny import tiny_config
from megarl.workers.group import TrainGroup, WorkerError, WorkerTimeout, call_rollout, get_all, stop_ranks
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
    with pytest.raises(WorkerTimeout, match=r"the rollout actor did not answer step within 1 s \(trainer.worker_timeout_s\); "
                                           "killed it"):
        call_rollout(rollout, "step", False, 600, timeout=1)
    assert time.monotonic() - start < 20
    with pytest.raises(ray.exceptions.RayActorError):  # killed: a shutdown call would have queued for 600 s
        ray.get(rollout.step.remote(False), timeout=30)


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
