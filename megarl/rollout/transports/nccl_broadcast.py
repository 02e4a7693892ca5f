"""Disaggregated weight transport: NCCL broadcast from one trainer rank to a server's TP ranks.

The trainer rank is rank 0 of a dedicated NCCL group with the server's TP ranks (1..tp), built by
SGLang's /init_weights_update_group on the server side and a separate process group here (the
trainer's default group is megatron's and stays untouched). Each bucket: post the names, dtypes and
shapes to /update_weights_from_distributed, broadcast the tensors in that order meanwhile; or, with
`flattened` (the default), the bucket packed into one uint8 buffer (cuda_ipc.flat_layout, the layout
of SGLang's FlattenedTensorBucket) and broadcast once ("flattened_bucket" load format): one
collective per bucket instead of one per tensor.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.rollout.transports import cuda_ipc


class NcclBroadcast:
    def __init__(self, server, master_address: str, master_port: int, group_name: str = "megarl_weights",
                 flattened: bool = True):
        from sglang.srt.utils.common import init_custom_process_group

        self.server, self.group_name, self.flattened = server, group_name, flattened
        world = 1 + server.tp
        request = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                   "world_size": world, "group_name": group_name, "backend": "nccl"}
        # Both sides block in the rendezvous: the server's half runs in a thread.
        joined = _in_thread(lambda: server.post("/init_weights_update_group", request))
        self.group = init_custom_process_group(
            backend="nccl", init_method=f"tcp://{master_address}:{master_port}", world_size=world, rank=0,
            group_name=group_name, timeout=timedelta(minutes=5))
        joined()

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        request = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                   "flush_cache": flush_cache, "load_format": "flattened_bucket" if self.flattened else None}
        if self.flattened:
            _, size = cuda_ipc.flat_layout(bucket)
            tensors = [cuda_ipc.pack(bucket, torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device))]
        else:
            tensors = [t.detach().contiguous() for _, t in bucket]
        done = _in_thread(lambda: self.server.post("/update_weights_from_distributed", request))
        for t in tensors:
            dist.broadcast(t, src=0, group=self.group)
        torch.cuda.synchronize()
        done()

    def close(self) -> None:
        self.server.post("/destroy_weights_update_group", {"group_name": self.group_name})
        dist.destroy_process_group(self.group)


def _in_thread(fn):
    """Run fn in a thread; the returned callable joins it and re-raises its exception."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as error:  # re-raised in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    return join
