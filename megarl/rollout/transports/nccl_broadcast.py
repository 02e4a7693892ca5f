"""Disaggregated weight transport: a broadcast from one trainer rank to each server's TP ranks.

The trainer rank is rank 0 of a dedicated group per server with that server's TP ranks (1..tp), built by
SGLang's /init_weights_update_group on the server side and `weight_group` here (the trainer's default
group is megatron's and stays untouched). Each bucket: post the names, dtypes and shapes to
/update_weights_from_distributed, broadcast the tensors in that order meanwhile; or, with `flattened`
(the default), the bucket packed into one uint8 buffer (flat_bucket.py, the layout of SGLang's
FlattenedTensorBucket) and broadcast once ("flattened_bucket" load format): one collective per bucket
instead of one per tensor. The backend is NCCL for CUDA tensors; gloo for CPU ones (tests, against
tests/rollout/fake_sglang.py).

Both ends of an NCCL group must agree on NCCL_CUMEM_ENABLE (NCCL's cuMem buffers or legacy IPC between the
peers): SGLang sets it to 0 where it is unset, so this side does too, before its first NCCL communicator
(the GPU scripts export it). With a mismatch the server's half fails with CUDA "invalid argument".
A server that fails its half (or does not answer) aborts this side's broadcast instead of leaving it
waiting on a peer that never comes.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from megarl.rollout.sglang_server import SGLangError, free_port
from megarl.rollout.transports.flat_bucket import flat_layout, pack

Bucket = list[tuple[str, torch.Tensor]]


def weight_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                 timeout: timedelta = timedelta(minutes=5)):
    """A process group of its own (beside any default group), rendezvousing at `init_method` (tcp://host:port,
    rank 0 serves the store). The steps of SGLang's init_custom_process_group, which builds the server's half:
    both halves must key the store alike (a PrefixStore named after the group) for the backend to meet."""
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are its global ranks
    return group


def bucket_request(bucket: Bucket, flattened: bool, flush_cache: bool = False) -> tuple[dict, list[torch.Tensor]]:
    """The /update_weights_from_distributed body of a bucket (less the group name) and the tensors to
    broadcast in its order: one packed uint8 buffer, or each tensor."""
    request = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
               "shapes": [list(t.shape) for _, t in bucket], "flush_cache": flush_cache,
               "load_format": "flattened_bucket" if flattened else None}
    if flattened:
        _, size = flat_layout(bucket)
        return request, [pack(bucket, torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device))]
    return request, [t.detach().contiguous() for _, t in bucket]


class NcclBroadcast:
    """This rank's half of one server's weight group."""

    def __init__(self, server, master_address: str, master_port: int, group_name: str = "megarl_weights",
                 flattened: bool = True, backend: str = "nccl"):
        if backend == "nccl":
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # SGLang's value (module docstring)
        self.server, self.group_name, self.flattened = server, group_name, flattened
        self.pool = ThreadPoolExecutor(1)  # the server's half of each collective call
        world = 1 + server.tp
        request = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                   "world_size": world, "group_name": group_name, "backend": backend}
        # Both sides block in the rendezvous: the server's half runs in a thread.
        joined = self.pool.submit(server.post, "/init_weights_update_group", request)
        self.group = weight_group(backend, f"tcp://{master_address}:{master_port}", world, 0, group_name)
        joined.result()

    def send_bucket(self, bucket: Bucket, flush_cache: bool) -> None:
        self.finish(self.start(*bucket_request(bucket, self.flattened, flush_cache)))

    def start(self, request: dict, tensors: list[torch.Tensor]) -> tuple[list, Future]:
        """Post the bucket's description and start its broadcasts; `finish` waits for both."""
        posted = self.pool.submit(self.server.post, "/update_weights_from_distributed",
                                  request | {"group_name": self.group_name})
        return [dist.broadcast(t, group_src=0, group=self.group, async_op=True) for t in tensors], posted

    def finish(self, started: tuple[list, Future]) -> None:
        works, posted = started
        self._wait(works, posted)
        posted.result()

    def _wait(self, works: list, posted: Future) -> None:
        """Until the broadcasts complete; should the server's half fail first (its post raised: an error
        answer, or no answer within the request timeout), abort the group and raise that error."""
        while not all(w.is_completed() for w in works):
            if posted.done() and posted.exception() is not None:
                self.group.abort()
                raise posted.exception()
            time.sleep(0.001)
        if torch.cuda.is_available():  # the buffer is freed next: its last use must be over on every stream
            torch.cuda.synchronize()

    def close(self) -> None:
        """Both halves of the group destroyed (the server's may be gone with its process: nothing to do there)."""
        try:
            self.server.post("/destroy_weights_update_group", {"group_name": self.group_name})
        except SGLangError:
            pass
        dist.destroy_process_group(self.group)
        self.pool.shutdown()


class NcclSender:
    """Sends buckets to a set of SGLang endpoints (megarl.rollout.sglang_server.Endpoint) over one group per server,
    the groups built at the first bucket (NCCL for CUDA tensors, gloo for CPU ones) and kept across syncs."""

    def __init__(self, endpoints: list, master_address: str, flattened: bool = True):
        self.endpoints, self.master_address, self.flattened = endpoints, master_address, flattened
        self.groups: list[NcclBroadcast] = []

    def send(self, bucket: Bucket, flush_cache: bool = False, checksums=None) -> Callable[..., None]:
        """Pack the bucket now (once for all servers) and return the call that broadcasts it to every server,
        post(): all broadcasts start before any is waited for (each server's group runs on its own). A
        verified sync's `checksums` table is left to the caller to flush (SGLang's own loader takes the bucket:
        its checksums come by a request of their own)."""
        if not self.groups:
            backend = "nccl" if bucket[0][1].is_cuda else "gloo"
            self.groups = [NcclBroadcast(e, self.master_address, port, f"megarl_weights_{port}", self.flattened,
                                         backend) for e in self.endpoints for port in [free_port()]]
        request, tensors = bucket_request(bucket, self.flattened, flush_cache)

        def post() -> None:
            started = [g.start(request, tensors) for g in self.groups]
            for group, handle in zip(self.groups, started):
                group.finish(handle)

        return post

    def close(self) -> None:
        for group in self.groups:
            group.close()
        self.groups = []
