"""Disaggregated weight transport: NCCL broadcast from one trainer rank to a server's TP ranks.

The trainer rank is rank 0 of a dedicated NCCL group with the server's TP ranks (1..tp), built by
SGLang's /init_weights_update_group on the server side and a separate process group here (the
trainer's default group is megatron's and stays untouched). Each bucket: post the names, dtypes and
shapes to /update_weights_from_distributed, broadcast the tensors in that order meanwhile; or, with
`flattened` (the default), the bucket packed into one uint8 buffer (cuda_ipc.flat_layout, the layout
of SGLang's FlattenedTensorBucket) and broadcast once ("flattened_bucket" load format): one
collective per bucket instead of one per tensor.

Both ends of the group must agree on NCCL_CUMEM_ENABLE (NCCL's cuMem buffers or legacy IPC between the
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

import torch
import torch.distributed as dist

from megarl.rollout.transports import cuda_ipc


class NcclBroadcast:
    def __init__(self, server, master_address: str, master_port: int, group_name: str = "megarl_weights",
                 flattened: bool = True):
        from sglang.srt.utils.common import init_custom_process_group

        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # SGLang's value (module docstring)
        self.server, self.group_name, self.flattened = server, group_name, flattened
        self.pool = ThreadPoolExecutor(1)  # the server's half of each collective call
        world = 1 + server.tp
        request = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                   "world_size": world, "group_name": group_name, "backend": "nccl"}
        # Both sides block in the rendezvous: the server's half runs in a thread.
        joined = self.pool.submit(server.post, "/init_weights_update_group", request)
        self.group = init_custom_process_group(
            backend="nccl", init_method=f"tcp://{master_address}:{master_port}", world_size=world, rank=0,
            group_name=group_name, timeout=timedelta(minutes=5))
        joined.result()

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        request = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                   "flush_cache": flush_cache, "load_format": "flattened_bucket" if self.flattened else None}
        if self.flattened:
            _, size = cuda_ipc.flat_layout(bucket)
            tensors = [cuda_ipc.pack(bucket, torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device))]
        else:
            tensors = [t.detach().contiguous() for _, t in bucket]
        posted = self.pool.submit(self.server.post, "/update_weights_from_distributed", request)
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors]
        self._wait(works, posted)
        torch.cuda.synchronize()
        posted.result()

    def _wait(self, works: list, posted: Future) -> None:
        """Until the broadcasts complete; should the server's half fail first (its post raised: an error
        answer, or no answer within the request timeout), abort the group and raise that error."""
        while not all(w.is_completed() for w in works):
            if posted.done() and posted.exception() is not None:
                self.group.abort()
                raise posted.exception()
            time.sleep(0.001)

    def close(self) -> None:
        self.server.post("/destroy_weights_update_group", {"group_name": self.group_name})
        dist.destroy_process_group(self.group)
        self.pool.shutdown()
