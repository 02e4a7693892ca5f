"""How a sending training rank hands a sync's buckets to the rollout engine: one `WeightSender` per transport, chosen
once per set of servers by `sender_for` from the rollout engine's answer to the sync's begin (SGLang's endpoints, or
none), the delivery and the servers' placement:

  rollout engine          delivery   placement                      sender
  none (the rollout actor loads: the hf engine)                     ActorLoadSender (Ray's object store)
  SGLang                  full       colocated (cuda_ipc)           cuda_ipc.CudaIpcSender
  SGLang                  full       disaggregated (nccl)           nccl_broadcast.NcclSender
  SGLang                  full       both (colocated on nodes)      SplitSender
  SGLang                  sharded    colocated                      cuda_ipc.ShardedIpcSender

A new delivery (LoRA adapters, FP8 weights) is a new sender and a new row of `FULL_SENDERS` or of `sender_for`.
Verification wraps whichever sender is chosen (megarl.workers.sync_checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megarl.rollout.transports import cuda_ipc, nccl_broadcast

Bucket = list[tuple[str, torch.Tensor]]


class WeightSender(Protocol):
    """Hands buckets to the rollout engine."""

    def send(self, bucket: Bucket, flush_cache: bool = False, checksums=None) -> Callable[[], None]:
        """Prepare the bucket now (pack it; with `checksums`, a verified sync's table holding this bucket's queued
        pieces, which a sender that packs sums in the same pass) and return its post: the call that delivers it,
        run in a thread while the next bucket is prepared; the bucket's memory is not touched again until it
        returned."""

    def close(self) -> None:
        """Release what the sender holds on both sides (NCCL weight groups, mapped CUDA IPC buffers)."""


class ActorLoadSender:
    """The rollout actor loads each bucket itself (the rollout engine handed out no endpoints: the hf engine), through
    Ray's object store: `load(bucket)` starts the load and returns the wait for it. Its engine's checksums come when
    asked, after the sync."""

    def __init__(self, load: Callable[[Bucket], Callable[[], None]]):
        self.load = load

    def send(self, bucket: Bucket, flush_cache: bool = False, checksums=None) -> Callable[[], None]:
        return self.load(bucket)

    def close(self) -> None:
        pass


class SplitSender:
    """Colocated servers on several nodes (megarl.workers.group.start_colocated_hosts): those on the sending rank's
    GPUs by CUDA IPC, the others by NCCL broadcast (which cannot reach a server sharing the sender's GPU: NCCL refuses
    two ranks of a group on one device). The IPC sender sums a verified sync's checksums; the broadcast sends the
    same bucket."""

    def __init__(self, posting, broadcast):
        self.posting, self.broadcast = posting, broadcast

    def send(self, bucket: Bucket, flush_cache: bool = False, checksums=None) -> Callable[[], None]:
        posts = (self.broadcast.send(bucket, flush_cache), self.posting.send(bucket, flush_cache, checksums))

        def post() -> None:
            for send in posts:
                send()
        return post

    def close(self) -> None:
        self.posting.close()
        self.broadcast.close()


@dataclass(frozen=True)
class SenderSettings:
    """What a rank's senders are built with: the CUDA IPC payload format (rollout.sglang_weight_format; NCCL sends
    the flat layout of the CUDA IPC formats, one broadcast per bucket, or with "tensors" one broadcast per tensor),
    the serialiser of CUDA IPC handles (None: SGLang's), and this rank's address (NCCL's weight groups rendezvous
    there)."""

    weight_format: str = "persistent"
    serializer: Callable | None = None
    master_address: str = "127.0.0.1"


def _ipc(endpoints: list, how: SenderSettings) -> WeightSender:
    return cuda_ipc.CudaIpcSender(endpoints, how.weight_format, how.serializer)


def _nccl(endpoints: list, how: SenderSettings) -> WeightSender:
    return nccl_broadcast.NcclSender(endpoints, how.master_address, flattened=how.weight_format != "tensors")


def _split(endpoints: list, how: SenderSettings) -> WeightSender:
    return SplitSender(_ipc([e for e in endpoints if e.transport == "cuda_ipc"], how),
                       _nccl([e for e in endpoints if e.transport == "nccl"], how))


# full delivery into SGLang, by the servers' placement (`placement`)
FULL_SENDERS = {"colocated": _ipc, "disaggregated": _nccl, "both": _split}


def placement(endpoints: list) -> str:
    """Where SGLang's servers are, as their endpoints' transports say: colocated (CUDA IPC), disaggregated (NCCL
    broadcast), or both."""
    transports = {e.transport for e in endpoints}
    return "both" if transports == {"cuda_ipc", "nccl"} else "disaggregated" if transports == {"nccl"} else "colocated"


def sender_for(endpoints: list | None, how: SenderSettings, load: Callable[[Bucket], Callable[[], None]],
               group=None) -> WeightSender:
    """The sender of a sync whose begin returned `endpoints` (None: the rollout actor loads each bucket, `load`). With
    a generation TP `group` (sharded delivery) its ranks send their shards together by CUDA IPC, persistent buffers
    (cuda_ipc.ShardedIpcSender refuses servers it cannot feed, naming them)."""
    if endpoints is None:
        return ActorLoadSender(load)
    if group is not None:
        return cuda_ipc.ShardedIpcSender(endpoints, group, how.serializer)
    return FULL_SENDERS[placement(endpoints)](endpoints, how)
