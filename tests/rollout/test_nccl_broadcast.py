"""The disaggregated transport's failure handling (the NCCL collectives themselves need GPUs: weight_sync.py nccl)."""

from concurrent.futures import Future

import pytest

from megarl.rollout.sglang_server import SGLangError
from megarl.rollout.transports.nccl_broadcast import NcclBroadcast


class Work:
    def __init__(self, completes_after: int | None):
        self.polls, self.completes_after = 0, completes_after

    def is_completed(self) -> bool:
        self.polls += 1
        return self.completes_after is not None and self.polls > self.completes_after


class Group:
    aborted = False

    def abort(self):
        self.aborted = True


def transport() -> NcclBroadcast:
    t = NcclBroadcast.__new__(NcclBroadcast)  # no server, no NCCL group: only the waiting logic
    t.group = Group()
    return t


def test_a_server_that_fails_its_half_aborts_the_broadcast_instead_of_hanging():
    t, posted = transport(), Future()
    posted.set_exception(SGLangError("/update_weights_from_distributed: HTTP 400: invalid argument"))
    with pytest.raises(SGLangError, match="invalid argument"):
        t._wait([Work(completes_after=None)], posted)  # a broadcast whose peer never comes
    assert t.group.aborted


def test_broadcasts_that_complete_are_waited_for_and_nothing_is_aborted():
    t, posted = transport(), Future()
    works = [Work(completes_after=3), Work(completes_after=0)]
    t._wait(works, posted)  # the server's answer may come after our broadcasts complete
    assert works[0].polls == 4 and not t.group.aborted
