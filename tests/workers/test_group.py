"""The driver's wait on the training ranks."""

import time

import pytest
import ray

from megarl.workers.group import get_all, stop_ranks


@ray.remote
class Rank:
    def step(self, fail: bool, wait: float = 0.0) -> str:
        if fail:
            raise RuntimeError("rank failed: server died mid-sync")
        time.sleep(wait)  # a rank waiting in a collective on the failed one
        return "done"

    def shutdown(self) -> None:
        pass


def test_get_all_fails_as_soon_as_one_rank_fails_while_others_still_wait(ray_local):
    ranks = [Rank.remote() for _ in range(3)]
    assert get_all([r.step.remote(False) for r in ranks]) == ["done"] * 3
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError, match="server died mid-sync"):
        get_all([ranks[0].step.remote(False, 60), ranks[1].step.remote(True), ranks[2].step.remote(False, 60)])
    assert time.monotonic() - start < 30
    for r in ranks:
        ray.kill(r)


def test_stop_ranks_kills_a_rank_stuck_after_a_failure(ray_local):
    ranks = [Rank.remote() for _ in range(2)]
    stuck = ranks[1].step.remote(False, 600)  # still in a collective with a rank that failed
    start = time.monotonic()
    stop_ranks(ranks, timeout=3)
    assert time.monotonic() - start < 20
    with pytest.raises(ray.exceptions.RayActorError):  # killed, not left running
        ray.get(stuck, timeout=20)
