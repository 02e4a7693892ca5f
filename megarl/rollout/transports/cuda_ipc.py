"""Colocated weight transport: CUDA IPC handles through SGLang's /update_weights_from_tensor.

The sender keeps its tensors on its own GPU and posts only IPC handles (ForkingPickler payloads,
base64 in JSON), one payload per SGLang TP rank, each serialised separately (a rank that opens
another rank's payload would upset torch's producer-side IPC reference counts); each rank opens the
handles and copies what its model loader needs. Three payload formats (`FORMATS`):

- "tensors": one handle per tensor, SGLang's default loader (the reference path).
- "flattened_bucket": the bucket copied into one flat uint8 buffer with SGLang's own
  FlattenedTensorMetadata; one handle per bucket.
- "persistent": the same flat layout, but in two buffers the sender allocates once and reuses
  (double buffering), loaded by sglang_loader.load_flat_bucket (SGLang's --custom-weight-loader) which keeps
  its mapping of each buffer open: SGLang opens an IPC handle once per buffer, not once per bucket
  per sync (opening and closing a mapping costs time that grows with its size).

`ShardedIpcSender` is the zero-redundancy form of "persistent" (rollout.weight_delivery=sharded): each SGLang
TP rank's payload is the buffer of the training rank holding its TP shard, loaded as presharded weights
(sglang_loader.load_presharded).

A sync (megarl.workers.weight_sync.push_policy) runs the HTTP call of bucket k in a thread while the caller packs
bucket k+1 and gathers and converts bucket k+2. The sender's tensors (or buffer slot) stay untouched until their call
returned: SGLang copies from our memory inside that call, and the "persistent" loader synchronises before returning.
The loader's side of "persistent" runs inside SGLang: sglang_loader.py.
"""

from __future__ import annotations

import base64
import json
import pickle
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megarl.rollout.transports.flat_bucket import Bucket, flat_layout, pack
from megarl.rollout.transports.sglang_loader import PERSISTENT_LOADER
from megarl.utils.checksum import ChecksumTable

FORMATS = ("tensors", "flattened_bucket", "persistent")


def sglang_serializer() -> Callable[[object], str]:
    """SGLang's ForkingPickler serialiser (base64 for JSON), with IPC handles naming GPUs by UUID so
    processes that see different CUDA_VISIBLE_DEVICES agree."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return lambda obj: MultiprocessingSerializer.serialize(obj, output_str=True)


def plain_serializer(obj) -> str:
    """CPU stand-in for tests: pickled values instead of IPC handles, same JSON envelope."""
    return base64.b64encode(pickle.dumps(obj)).decode()


class CudaIpcSender:
    """Posts buckets to SGLang endpoints (megarl.rollout.sglang_server.Endpoint) in one of FORMATS.

    Lives in the process that holds the tensors (the training rank), so the weights never leave
    their GPU on the way: no Ray object store, no host copies.
    """

    def __init__(self, endpoints: list, fmt: str = "flattened_bucket", serializer: Callable[[object], str] | None = None,
                 slots: int = 2):
        if fmt not in FORMATS:
            raise ValueError(f"weight format {fmt!r}: expected one of {', '.join(FORMATS)}")
        self.endpoints, self.fmt, self.slots = endpoints, fmt, slots
        self.serialize = serializer or sglang_serializer()
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.count = 0  # buckets sent: picks the persistent slot

    def payload(self, bucket: Bucket, checksums: ChecksumTable | None) -> tuple[str | None, Callable, object]:
        """The load format of one bucket's request, the payload of SGLang TP rank r of an endpoint
        (payload(endpoint, r)), and the object that must stay alive until the request returns."""
        if self.fmt == "tensors":
            keep = [(n, t.detach()) for n, t in bucket]
            return None, lambda endpoint, rank: self.serialize(keep), keep
        if self.fmt == "flattened_bucket":
            layout, size = flat_layout(bucket)
            flat = pack(bucket, torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device), checksums)
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

            meta = [FlattenedTensorMetadata(name=n, shape=torch.Size(s), dtype=getattr(torch, d), start_idx=a,
                                            end_idx=b, numel=b - a) for n, d, s, a, b in layout]
            obj = {"flattened_tensor": flat, "metadata": meta}
            return "flattened_bucket", lambda endpoint, rank: self.serialize(obj), flat
        header, flat = self.persistent(bucket, checksums)
        return PERSISTENT_LOADER, lambda endpoint, rank: self.serialize([(json.dumps(header), flat)]), flat

    def persistent(self, bucket: Bucket, checksums: ChecksumTable | None = None, **header) -> tuple[dict, torch.Tensor]:
        """The bucket packed into this bucket's slot buffer (grown when too small; with `checksums`, summed in
        the same pass: `pack`): the persistent loader's header and the buffer's used prefix."""
        layout, size = flat_layout(bucket)
        device = bucket[0][1].device
        slot = self.count % self.slots
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = self.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        flat = pack(bucket, buffer, checksums)
        return {"slot": slot, "layout": layout, **header}, flat

    def send(self, bucket: Bucket, flush_cache: bool = False,
             checksums: ChecksumTable | None = None) -> Callable[..., None]:
        """Prepare the bucket now (copies on our GPU; with `checksums`, a verified sync's table holding this
        bucket's queued pieces, summed by the copy) and return the call that posts it to every endpoint,
        post(): run it before changing the bucket's memory again."""
        load_format, payload, keep = self.payload(bucket, checksums)
        self.count += 1
        # The pack (and the conversions before it) are queued on our stream, not done. A receiver that opens a
        # handle waits on the event torch's IPC sends along, but one that has it open already (SGLang keeps the
        # persistent buffers mapped: torch's rebuild_cuda_tensor then takes its cached storage) does not wait:
        # the post waits for the copies instead, in its thread, so the next bucket's work still overlaps.
        device = bucket[0][1].device
        packed = torch.cuda.Event() if device.type == "cuda" else None
        if packed is not None:
            packed.record(torch.cuda.current_stream(device))

        def post() -> None:
            nonlocal keep  # our tensors stay alive until every endpoint has copied from them
            if packed is not None:
                with record_function("megarl.sync.post_waits_for_pack"):  # in the post's thread, by design
                    packed.synchronize()
            for endpoint in self.endpoints:
                with record_function("megarl.sync.post_serialize"):  # here: each handle is opened once
                    payloads = [payload(endpoint, r) for r in range(endpoint.tp)]
                with record_function("megarl.sync.post_request"):
                    endpoint.post("/update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                                  "load_format": load_format,
                                                                  "flush_cache": flush_cache})
            keep = None

        return post

    def close(self) -> None:
        """SGLang keeps the persistent buffers mapped (sglang_loader.load_flat_bucket) until told to let go; until
        then torch keeps their memory in its IPC limbo, and at exit torch 2.11 crashed freeing such blocks (SIGSEGV in
        ~CudaIPCSentData after a 7B sync into a TP=2 server)."""
        named = self.release_payload()
        if named is not None:
            payload = self.serialize(named)
            for endpoint in self.endpoints:
                post_release(endpoint, [payload] * endpoint.tp)
        self.free()

    def release_payload(self) -> Bucket | None:
        """The persistent loader's payload that makes SGLang drop its mappings; None if nothing is mapped."""
        held = [b for b in self.buffers if b is not None]
        return [(json.dumps({"release": True}), held[0][:1])] if held else None

    def free(self) -> None:
        self.buffers = [None] * self.slots
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the buffers SGLang let go of leave torch's IPC limbo


def checksum_file(prefix: str, rank: int) -> str:
    """Where SGLang TP rank `rank` of the server whose endpoint names `prefix` writes its checksums."""
    return f"{prefix}_rank{rank}.json"


def persistent_request(payloads: list[str], flush_cache: bool = False) -> dict:
    """The /update_weights_from_tensor body for the persistent loader: one payload per SGLang TP rank."""
    return {"serialized_named_tensors": payloads, "load_format": PERSISTENT_LOADER, "flush_cache": flush_cache}


def inspect_request(serialize: Callable[[object], str], placeholder: torch.Tensor, headers: list[dict]) -> dict:
    """A request about the weights held (inspect_weights), header r for SGLang TP rank r; the payload's tensor is a
    placeholder (SGLang moves it to the rank's device first)."""
    return persistent_request([serialize([(json.dumps(header), placeholder)]) for header in headers])


def post_release(endpoint, payloads: list[str]) -> None:
    try:
        endpoint.post("/update_weights_from_tensor", persistent_request(payloads))
    except RuntimeError:  # SGLangError: a server that is gone let go of everything with its process
        pass


class ShardedIpcSender(CudaIpcSender):
    """Zero-redundancy delivery into SGLang servers of TP=g: each rank of the trainer's first generation TP group
    (`group`, ranks 0..g-1) packs its own rows of each HF tensor (the resharder's "sharded" buckets, whatever the
    training TP and EP: the resharder moved the rows it lacked to it; with --ep-size only the routed experts of its
    SGLang rank's EP slice) into persistent buffers on its own GPU; group rank 0 gathers every rank's serialised
    payload and posts one request per bucket, payload r for SGLang TP rank r (colocated, on that rank's GPU), loaded
    with SGLang's presharded weight loading (`load_presharded`). Every rank calls `send` for every bucket
    (collectives on `group`, a CPU/gloo group); only rank 0's post does anything, and only rank 0 needs the
    endpoints."""

    def __init__(self, endpoints: list, group, serializer: Callable[[object], str] | None = None, slots: int = 2):
        super().__init__(endpoints, "persistent", serializer, slots)
        self.group, self.size = group, dist.get_world_size(group)
        self.first = dist.get_group_rank(group, dist.get_rank()) == 0
        for endpoint in endpoints:  # every rank of the group checks (it got the endpoints from rank 0): all fail alike
            if endpoint.tp != self.size or endpoint.transport != "cuda_ipc":
                raise ValueError(f"sharded weight delivery: server {endpoint.url} (TP={endpoint.tp}, weights by "
                                 f"{endpoint.transport}) cannot take the shards of a {self.size}-rank group by CUDA IPC: "
                                 f"it needs colocated servers of TP={self.size} (rollout.sglang_tp)")

    def send(self, bucket: Bucket, flush_cache: bool = False,
             checksums: ChecksumTable | None = None) -> Callable[..., None]:
        # This bucket's slot held bucket count - slots, which SGLang may read until rank 0's post of it returned.
        # Rank 0 gets here only after that (send_overlapped keeps one post in flight); the others wait for it here.
        dist.barrier(group=self.group)
        header, flat = self.persistent(bucket, checksums, presharded=True)
        self.count += 1
        if flat.is_cuda:  # SGLang holds the buffer mapped: it does not wait on torch's IPC event for our pack
            torch.cuda.current_stream(flat.device).synchronize()
        payloads = [None] * self.size if self.first else None
        dist.gather_object(self.serialize([(json.dumps(header), flat)]), payloads, group_dst=0, group=self.group)
        if not self.first:
            return lambda: None
        request = persistent_request(payloads, flush_cache)

        def post() -> None:
            for endpoint in self.endpoints:
                endpoint.post("/update_weights_from_tensor", request)

        return post

    def close(self) -> None:
        """As CudaIpcSender.close, for every rank's buffers: rank 0 posts them all; every rank of the group
        calls this (TrainWorker.shutdown and push_policy's change of servers run on all of them)."""
        named = self.release_payload()
        payloads = [None] * self.size if self.first else None
        dist.gather_object(named and self.serialize(named), payloads, group_dst=0, group=self.group)
        if self.first and all(payloads):
            for endpoint in self.endpoints:
                post_release(endpoint, payloads)
        dist.barrier(group=self.group)  # SGLang let go of every rank's buffers
        self.free()
