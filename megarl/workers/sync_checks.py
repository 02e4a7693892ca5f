"""What a sending training rank computes of what it sends, to prove a sync arrived intact: tees on the bucket stream.

A sync's verification (trainer.verify_weight_sync_every) wraps its sender (megarl.workers.weight_senders) with one of
`SyncCheck`'s kinds, each seeing every bucket as it is handed over:
- `ChecksumTee` (the default): each tensor goes into the ExpectedChecksums of the engine's layout
  (megarl.rollout.weight_layout), summed on the sender's device by the same kernel pass that packs the bucket (CUDA IPC)
  or right after it; nothing else is kept, and the engine's own checksums are asked for later
  (megarl.workers.weight_sync.verify_checksums compares the two).
- `DigestTee` (trainer.verify_weight_sync_deep): digests of what was sent, and for SGLang host copies that it reloads
  from a file with its own loader (a generation TP group's rank 0 gathers its ranks' shards: `assemble`).
- `Unchecked`: nothing.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megarl.reshard.layout import as_generation
from megarl.rollout.weight_layout import ExpectedChecksums
from megarl.utils.checksum import checksums

Bucket = list[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from what the trainer sent."""


def digests(tensors: list[torch.Tensor]) -> list[tuple]:
    """Bitwise fingerprints (dtype, shape, sums) of tensors; one host sync for all of them."""
    return fingerprints([(t.dtype, t.shape) for t in tensors], checksums(tensors))


def fingerprints(meta: list[tuple[torch.dtype, torch.Size]], sums: list[torch.Tensor]) -> list[tuple]:
    values = torch.stack([s.cpu() for s in sums]).tolist() if sums else []
    return [(str(dtype), tuple(shape), *v) for (dtype, shape), v in zip(meta, values)]


def tensor_digest(t: torch.Tensor) -> tuple:
    """Bitwise fingerprint of one tensor's values (dtype and shape included)."""
    return digests([t])[0]


# What was sent is keyed by HF name, or by (name, dim, lo, hi) for rows [lo, hi) along `dim` of it (a TP shard).
Key = str | tuple[str, int, int, int]


def shard_key(specs: list, gen, rank: int) -> Callable[[str], Key]:
    """Sharded delivery: the key of what generation rank `rank` of `gen` (a megarl.reshard GenLayout, or a bare
    generation TP) sends of each HF tensor (megarl's inventory TensorSpecs) it holds: its name where that is the
    whole tensor, else (name, dim, lo, hi)."""
    by_name, gen = {s.name: s for s in specs}, as_generation(gen)

    def key(name: str) -> Key:
        spec = by_name[name]
        lo, hi = gen.rows(spec, rank)
        return name if spec.dim is None or (lo, hi) == (0, spec.length) else (name, spec.dim, lo, hi)

    return key


def digests_of(named: dict[str, torch.Tensor], dtypes: dict[Key, torch.dtype]) -> dict[Key, tuple]:
    """Digests of an engine's own weights (or of the rows a key names), each cast to the dtype it was sent in;
    computed on a GPU where this process has one (SGLang's engine holds host copies of a verified sync)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys, meta, sums = [], [], []
    for key, dtype in dtypes.items():
        name, rows = (key, None) if isinstance(key, str) else (key[0], key[1:])
        if name in named:
            t = named[name] if rows is None else named[name].narrow(rows[0], rows[1], rows[2] - rows[1])
            keys.append(key)
            meta.append((dtype, t.shape))
            sums.extend(checksums([t.to(device, dtype)]))  # one tensor's copy on the device at a time
    return dict(zip(keys, fingerprints(meta, sums)))


def assemble(parts: list[dict[Key, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole HF tensors from the generation TP ranks' shards (one dict per rank, keyed as `Key`s say): row blocks
    concatenated along their dimension (blocks held by several ranks, such as K/V heads at TP above their count,
    once); a replicated tensor is rank 0's. Blocks that leave a gap fail naming the tensor."""
    blocks: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    whole, dims = {}, {}
    for part in parts:
        for key, tensor in part.items():
            if isinstance(key, str):
                whole.setdefault(key, tensor)
            else:
                name, dims[name], lo, hi = key
                blocks.setdefault(name, {}).setdefault((lo, hi), tensor)
    for name, rows in blocks.items():
        order = sorted(rows)
        ends = [0] + [hi for _, hi in order[:-1]]
        if [lo for lo, _ in order] != ends:
            raise WeightSyncError(f"{name}: the generation TP ranks' row blocks {order} do not tile its rows")
        whole[name] = torch.cat([rows[r] for r in order], dim=dims[name])
    return whole


class SyncCheck(Protocol):
    """A sync's verification, seeing each bucket as it is handed to the sender. `seconds`: its own work on the sync's
    path (the report's digest_s, with what `result` takes)."""

    seconds: float

    def begin(self) -> None:
        """A sync starts."""

    def send(self, sender, bucket: Bucket, direct: bool) -> Callable[[], None]:
        """Hand `bucket` to `sender` (direct: it posts to SGLang from here) and return its post."""

    def sent(self) -> None:
        """The last bucket was handed over."""

    def received(self) -> dict | None:
        """What the rollout engine's `end_weight_update` keeps for its own check (None: nothing to check)."""

    def result(self, report) -> None:
        """Fill the report's `sent` or `expected`."""


class Unchecked:
    """An unverified sync."""

    seconds = 0.0

    def begin(self) -> None:
        pass

    def send(self, sender, bucket: Bucket, direct: bool) -> Callable[[], None]:
        with record_function("megarl.sync.pack"):
            return sender.send(bucket)

    def sent(self) -> None:
        pass

    def received(self) -> None:
        return None

    def result(self, report) -> None:
        pass


class ChecksumTee:
    """Verification by checksums: each tensor sent goes into `expected` (by `key(name)`), summed where the sender packs
    the bucket by the pack's own copy (CUDA IPC), else right after the sender took it (the bucket's memory is reused
    once it is sent). `expected` is kept across syncs (its plans and table): each sync begins it, and queues its
    read-back once the last bucket is sent, so the host waits for the sums only in `result`, after the sync's end."""

    def __init__(self, expected: ExpectedChecksums, key: Callable[[str], Key]):
        self.expected, self.key, self.seconds = expected, key, 0.0

    def begin(self) -> None:
        self.expected.begin()  # one ExpectedChecksums serves every sync (its plans and table are kept)

    def send(self, sender, bucket: Bucket, direct: bool) -> Callable[[], None]:
        t = time.perf_counter()  # queued here, summed by the sender's pack in its pass over the bucket
        with record_function("megarl.sync.expected_add"):
            for n, x in bucket:
                self.expected.add(self.key(n), x)
        table = self.expected.table
        self.seconds += time.perf_counter() - t
        with record_function("megarl.sync.pack"):
            post = sender.send(bucket, checksums=table)
        self.expected.flush()  # what the sender did not sum: the bucket's memory is reused once it is sent
        return post

    def sent(self) -> None:
        self.expected.fetch()  # the sums' read-back is queued now and waited for in result(), after the end

    def received(self) -> dict:
        return {}  # the engine's checksums come by a request of their own, after the sync

    def result(self, report) -> None:
        with record_function("megarl.sync.expected_result"):
            report.expected = self.expected.result()


class DigestTee:
    """The deep check: each tensor's dtype and digest by `key(name)`, its sums queued on the device behind the pack
    (not the tensors: one bucket in memory); a direct sync also keeps host copies for SGLang's reload check. With a
    generation TP `group` (sharded delivery), its rank 0 gathers every rank's copies, bucket by bucket, and hands
    the engine the whole tensors (`assemble`)."""

    def __init__(self, key: Callable[[str], Key], group=None):
        self.key, self.group, self.seconds = key, group, 0.0
        self.first = group is None or dist.get_group_rank(group, dist.get_rank()) == 0
        self.meta: list[tuple] = []  # (key, dtype, shape) of every tensor sent
        self.sums: list[torch.Tensor] = []
        self.copies: dict = {}
        self.shards: list[dict] = []  # on group rank 0: every rank's host copies, bucket by bucket

    def begin(self) -> None:
        pass

    def send(self, sender, bucket: Bucket, direct: bool) -> Callable[[], None]:
        with record_function("megarl.sync.pack"):
            post = sender.send(bucket)
        t = time.perf_counter()
        self.meta.extend((self.key(n), x.dtype, x.shape) for n, x in bucket)
        self.sums.extend(checksums([x for _, x in bucket]))  # queued on the device behind the pack
        if direct:
            copies = {self.key(n): x.detach().to("cpu", copy=True) for n, x in bucket}
            if self.group is None:
                self.copies.update(copies)
            else:  # every bucket's at once: rank 0's staging of the gather stays within a bucket
                parts = [None] * dist.get_world_size(self.group) if self.first else None
                dist.gather_object(copies, parts, group_dst=0, group=self.group)
                self.shards.extend(parts or [])
        self.seconds += time.perf_counter() - t
        return post

    def sent(self) -> None:
        pass

    def received(self) -> dict:
        if self.group is not None and self.first:
            return assemble(self.shards)
        return self.copies

    def result(self, report) -> None:
        done = fingerprints([(dtype, shape) for _, dtype, shape in self.meta], self.sums)
        report.sent = {k: (dtype, d) for (k, dtype, _), d in zip(self.meta, done)}
