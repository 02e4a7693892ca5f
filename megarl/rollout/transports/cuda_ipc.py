"""Colocated weight transport: CUDA IPC handles through SGLang's /update_weights_from_tensor.

The sender keeps its tensors on its own GPU and posts only IPC handles (ForkingPickler payloads,
base64 in JSON), one payload per SGLang TP rank, each serialised separately (a rank that opens
another rank's payload would upset torch's producer-side IPC reference counts); each rank opens the
handles and copies what its model loader needs. Three payload formats (`FORMATS`):

- "tensors": one handle per tensor, SGLang's default loader (the reference path).
- "flattened_bucket": the bucket copied into one flat uint8 buffer with SGLang's own
  FlattenedTensorMetadata; one handle per bucket.
- "persistent": the same flat layout, but in two buffers the sender allocates once and reuses
  (double buffering), loaded by `load_flat_bucket` (SGLang's --custom-weight-loader) which keeps
  its mapping of each buffer open: SGLang opens an IPC handle once per buffer, not once per bucket
  per sync (opening and closing a mapping costs time that grows with its size).

`ShardedIpcSender` is the zero-redundancy form of "persistent" (rollout.weight_delivery=sharded): each SGLang
TP rank's payload is the buffer of the training rank holding its TP shard, loaded as presharded weights.

`send_overlapped` runs the HTTP call of bucket k in a thread while the caller packs bucket k+1 and gathers
and converts bucket k+2. The sender's tensors (or buffer slot) stay untouched until their call returned: SGLang
copies from our memory inside that call, and the "persistent" loader synchronises before returning.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megarl.rollout.weight_layout import DERIVED_ATTRIBUTES
from megarl.utils.checksum import ChecksumTable

FORMATS = ("tensors", "flattened_bucket", "persistent")
PERSISTENT_LOADER = "megarl.rollout.transports.cuda_ipc.load_flat_bucket"

Bucket = list[tuple[str, torch.Tensor]]


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


def flat_layout(bucket: Bucket) -> tuple[list[list], int]:
    """[name, dtype, shape, start, end] per tensor in one uint8 buffer (SGLang's FlattenedTensorBucket
    layout: tensors back to back, no padding), and the buffer's size in bytes."""
    layout, offset = [], 0
    for name, t in bucket:
        size = t.numel() * t.element_size()
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, offset + size])
        offset += size
    return layout, offset


def pack(bucket: Bucket, out: torch.Tensor, checksums: ChecksumTable | None = None) -> torch.Tensor:
    """Copy the bucket's tensors into `out` (uint8) in flat_layout order; returns the used prefix. `checksums`:
    a table with this bucket's pieces queued (a verified sync), whose flush makes the copies in the same pass
    that sums them (each weight is read once)."""
    copies, offset = [], 0
    for _, t in bucket:
        size = t.numel() * t.element_size()
        copies.append((t, out[offset:offset + size].view(t.dtype).view(t.shape)))
        offset += size
    if checksums is not None:
        checksums.flush(copies)
    else:
        for source, destination in copies:
            destination.copy_(source)
    return out[:offset]


def unpack(flat: torch.Tensor, layout: list[list]) -> Bucket:
    """Views of `flat` named and shaped as `layout` says (no copies)."""
    return [(name, flat[start:end].view(getattr(torch, dtype)).view(shape)) for name, dtype, shape, start, end in layout]


_MAPPED: dict[int, torch.Tensor] = {}  # inside SGLang: slot -> the sender's buffer, kept mapped
# Benchmarks set MEGARL_TIME_WEIGHT_LOADS=1 in a server's environment: each load then prints its seconds to the
# server's log (`LOAD_TIMING` lines), which splits a post's time into SGLang's load and the request's way there and
# back; a verification's checksums print theirs (`CHECKSUM_TIMING`: seconds of the request's work, and the GPU
# seconds of the sums).
TIME_LOADS = os.environ.get("MEGARL_TIME_WEIGHT_LOADS") == "1"
LOAD_TIMING = "megarl weight load"
CHECKSUM_TIMING = "megarl checksums"


def load_flat_bucket(model, named_tensors: Bucket) -> None:
    """SGLang custom weight loader (runs in each SGLang TP worker): one (layout JSON, flat buffer) pair. A
    "presharded" header: the buffer holds this TP rank's own rows of each HF tensor (ShardedIpcSender). A header
    without a layout is a request about the weights held (inspect_weights)."""
    start = time.perf_counter()
    ((header, flat),) = named_tensors
    header = json.loads(header)
    if header.get("release"):  # the sender is closing (CudaIpcSender.close): let go of its buffers
        _MAPPED.clear()
        return
    if "layout" not in header:  # not weights: a request about the weights held
        inspect_weights(model, header)
        return
    bucket = unpack(flat, header["layout"])
    if header.get("presharded"):
        load_presharded(model, bucket)
    else:
        model.load_weights(bucket)
    queued = time.perf_counter()  # the loaders' Python work is done; the copies may still run
    if flat.is_cuda:  # the sender reuses the buffer once this call has returned
        torch.cuda.current_stream().synchronize()
    _MAPPED[header["slot"]] = flat
    if TIME_LOADS:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"{LOAD_TIMING}: rank {rank} bytes {flat.numel()} queued {queued - start:.6f} "
              f"seconds {time.perf_counter() - start:.6f}", file=sys.stderr, flush=True)


def derived_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor attribute named in weight_layout.DERIVED_ATTRIBUTES (SGLang's MLA w_kc and
    w_vc, which post_load_weights derives from kv_b_proj) that a module of `model` holds beside its parameters and
    buffers: verification checks them as parameters."""
    modules = model.named_modules() if isinstance(model, torch.nn.Module) else []
    found = []
    for prefix, module in modules:
        for attribute in DERIVED_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{attribute}" if prefix else attribute, value))
    return found


def inspect_weights(model, header: dict) -> None:
    """Inside an SGLang TP worker, on its GPU. {"checksums": file} writes to `file`, atomically, the checksums of
    every parameter, persistent buffer and derived tensor (`derived_tensors`) this rank holds now
    (megarl.utils.checksum.module_checksums); the caller reads it once the request returned. A verified sync asks
    for them after the rollout its weights generated, before the trainer trains on it (Trainer.check_rollout_weights):
    off the sync's path, of the same memory (generation only reads the weights). {"flip_bit": name} flips a bit of
    that tensor (a test hook standing for memory corrupted after a load: the next verification must name it; None:
    on another rank)."""
    from megarl.utils.checksum import flip_bit, module_checksums

    if "flip_bit" in header:
        if header["flip_bit"] is None:
            return
        held = dict(model.named_parameters()) | dict(derived_tensors(model))
        if header["flip_bit"] not in held:
            raise KeyError(f"no parameter {header['flip_bit']!r} (this rank holds {sorted(held)[:4]} ...)")
        flip_bit(held[header["flip_bit"]])
        return
    start = time.perf_counter()
    timed = TIME_LOADS and torch.cuda.is_available()
    if timed:
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record()
    held = module_checksums(model, extra=derived_tensors(model))
    if timed:
        events[1].record()
    staging = header["checksums"] + ".tmp"
    with open(staging, "w") as f:
        json.dump(held, f)
    os.replace(staging, header["checksums"])
    if TIME_LOADS:
        gpu_s = events[0].elapsed_time(events[1]) / 1e3 if timed else 0.0
        print(f"{CHECKSUM_TIMING}: params {len(held)} seconds {time.perf_counter() - start:.6f} gpu {gpu_s:.6f}",
              file=sys.stderr, flush=True)


def load_presharded(model, bucket: Bucket) -> None:
    """The model's own load_weights (it fuses q/k/v and gate/up by shard id) with every layer that has SGLang's
    `use_presharded_weights` switched on, so its weight_loader copies each tensor as this rank's shard instead
    of narrowing it; the switches are restored afterwards, also when a load fails. A wrong shape fails in the
    loaders' assertions, re-raised naming the tensor being loaded."""
    switched = [(m, m.use_presharded_weights) for m in model.modules() if hasattr(m, "use_presharded_weights")]
    current = ("(before the first tensor)", ())

    def tracked():
        nonlocal current
        for name, tensor in bucket:
            current = (name, tuple(tensor.shape))
            yield name, tensor

    try:
        for module, _ in switched:
            module.use_presharded_weights = True
        model.load_weights(tracked())
    except Exception as error:
        raise RuntimeError(f"presharded weight load failed at {current[0]} (rows of shape {list(current[1])}): "
                           f"{type(error).__name__}: {error}") from error
    finally:
        for module, before in switched:
            module.use_presharded_weights = before


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
        """SGLang keeps the persistent buffers mapped (load_flat_bucket) until told to let go; until then torch
        keeps their memory in its IPC limbo, and at exit torch 2.11 crashed freeing such blocks (SIGSEGV in
        ~CudaIPCSentData after a 7B sync into a TP=2 server, 2026-11-22)."""
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


SGLANG_VOCAB_PADDING = 64  # sglang's DEFAULT_VOCAB_PADDING_SIZE: VocabParallelEmbedding pads the vocabulary to it


def check_presharded_vocab(specs: list, tp: int) -> None:
    """SGLang's presharded embedding/lm_head loading takes exactly vocab // tp rows on every rank, placed at the
    rank's block of the vocabulary padded to a multiple of 64; megarl's shards (inventory TensorSpec.rows) must be
    those rows, else refuse before anything is sent."""
    for spec in specs:
        if not spec.pad_vocab:
            continue
        vocab = spec.length
        per = -(-vocab // SGLANG_VOCAB_PADDING) * SGLANG_VOCAB_PADDING // tp
        for rank in range(tp):
            ours, theirs = spec.rows(tp, rank), (rank * per, min((rank + 1) * per, vocab))
            if ours != theirs or ours[1] - ours[0] != vocab // tp:
                raise ValueError(
                    f"{spec.name}: vocabulary of {vocab} rows at TP={tp}: SGLang's presharded loading takes rows "
                    f"{list(theirs)} on rank {rank} and needs {vocab // tp} (vocab // tp) there, megarl's shard is "
                    f"{list(ours)}; sharded delivery into SGLang needs a vocabulary that is a multiple of "
                    f"{SGLANG_VOCAB_PADDING} and of TP: use rollout.weight_delivery=full")


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


def send_overlapped(buckets: Iterable[Bucket], prepare: Callable[[Bucket], Callable[[], None]]) -> dict:
    """For each bucket from `buckets` (whose production is the gather and convert work), `prepare(bucket)`
    returns the post; the post of bucket k runs in a thread while bucket k+1 is prepared and bucket k+2 produced
    (at most one post in flight: two buckets, or slots, in use). Returns seconds spent producing, preparing and
    waiting on posts, each post's seconds, and the bytes sent."""
    stats = dict(produce_s=0.0, prepare_s=0.0, wait_s=0.0, bytes=0, buckets=0, posts_s=[])

    def timed(post: Callable[[], None]) -> None:
        start = time.perf_counter()
        post()
        stats["posts_s"].append(time.perf_counter() - start)

    def produce() -> Bucket | None:
        t = time.perf_counter()
        bucket = next(iterator, None)
        stats["produce_s"] += time.perf_counter() - t
        return bucket

    pending = None
    with ThreadPoolExecutor(1) as pool:
        iterator = iter(buckets)
        bucket = produce()
        while bucket is not None:
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            stats["buckets"] += 1
            t1 = time.perf_counter()
            post = prepare(bucket)
            stats["prepare_s"] += time.perf_counter() - t1
            del bucket  # packed (or held by its post): free for the next one
            bucket = produce()
            t2 = time.perf_counter()
            if pending is not None:  # at most one post in flight: two buckets (or slots) in use
                pending.result()
            stats["wait_s"] += time.perf_counter() - t2
            pending = pool.submit(timed, post)
        t3 = time.perf_counter()
        if pending is not None:
            pending.result()
        stats["wait_s"] += time.perf_counter() - t3
    return stats
