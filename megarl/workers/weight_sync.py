"""Moving the policy from the training ranks into a rollout engine, and proving it arrived intact.

A sending training rank streams buckets out of the resharder (megarl.reshard) through its `PolicySync`, kept across
syncs (TrainWorker's, and the benchmarks'): `push_policy` is the overlapped loop over the buckets, bucket k in flight
while bucket k+1 is gathered and converted. The rollout engine's answer to the sync's begin picks the sender
(megarl.workers.weight_senders): SGLang hands out its endpoints and the rank sends each bucket itself (this process
owns the tensors, so they never leave the GPU on the way), by CUDA IPC to colocated servers (transports/cuda_ipc.py)
or by NCCL broadcast to servers on GPUs of their own (transports/nccl_broadcast.py); any other engine loads each
bucket in the rollout actor (through Ray's object store: `RolloutEngine.update_weights`, or a generation TP rank's
rows, `update_weight_shards`). The sync's account is a `SyncReport`.

Verification (trainer.verify_weight_sync_every), by default by checksums: the sending rank computes, bucket by
bucket on its device, what every parameter the engine holds must hash to (megarl.rollout.weight_layout: SGLang's
fused, sharded, padded parameters from the HF tensors sent; by the same kernel pass that packs the bucket), and
the engine computes the same checksums of the parameters as it holds them, where they live (inside SGLang's TP
workers, transports/sglang_loader.py inspect_weights), asked for after the sync, off its path: the trainer collects
them before it trains on anything those weights generated (RLTrainer.check_rollout_weights; generation only reads
the weights, so the sums are those of the memory the sync wrote), and `verify_checksums` compares the two and names
every parameter that differs, is missing, or was never sent. No copy of the weights leaves either GPU.
The deep check (trainer.verify_weight_sync_deep) instead keeps host copies of what was sent, has SGLang reload
them from a file with its own loader and compare, then digests the engine's weights against the sender's (`verify`).
Both are tees on the bucket stream: megarl.workers.sync_checks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megarl.rollout.sglang_layout import keep_fused_pairs
from megarl.rollout.weight_layout import ExpectedChecksums
from megarl.workers.sync_checks import ChecksumTee, DigestTee, Key, SyncCheck, Unchecked, WeightSyncError
from megarl.workers.weight_senders import SenderSettings, WeightSender, sender_for

Bucket = list[tuple[str, torch.Tensor]]


@dataclass
class SyncReport:
    """One sending rank's account of a sync (`push_policy`). Seconds: `seconds` on this rank from begin to end,
    and its split (`phases`), the sender's verification work (`digest_s`), each bucket's post (`posts_s`)."""

    bytes: int  # as the buckets hold them (bf16 on GPU)
    direct: bool  # sent from this rank to SGLang's endpoints (not loaded by the rollout actor)
    begin_s: float  # the wait for the engine's begin that the first bucket's work did not hide
    gather_convert_s: float  # producing the buckets (resharding, conversion to HF)
    pack_s: float  # preparing each bucket's post (packing it)
    transfer_s: float  # waiting for posts
    end_s: float  # the engine's end of the sync
    posts_s: list[float]
    digest_s: float = 0.0
    seconds: float = 0.0
    sent: dict = field(default_factory=dict)  # the deep check: (dtype, digest) of each tensor sent, by its Key
    expected: dict | None = None  # verification by checksums: ExpectedChecksums.result of what was sent

    PHASES = ("begin_s", "gather_convert_s", "pack_s", "transfer_s", "end_s")

    def phases(self) -> dict[str, float]:
        """The split of the sync's seconds, by phase name."""
        return {name: getattr(self, name) for name in self.PHASES}


@dataclass
class RankSync:
    """A training rank's part of a sync (TrainWorker.push_weights): its `report` where it speaks for the sync (a
    sender of the first generation TP group; None elsewhere) and its bytes beside the planner's (`traffic`)."""

    report: SyncReport | None
    traffic: dict | None


@dataclass(frozen=True)
class RolloutSide:
    """How this rank reaches the rollout engine for a sync. `begin()` starts it and returns SGLang's endpoints, or
    None: then `load(bucket)` hands each bucket to the rollout actor now and returns the wait for it. `end(received)`
    closes a sync sent to endpoints (`received`: host copies of what was sent, for SGLang's own check, on a
    deep-verified sync). `begin` and `end` None: another rank of this generation TP group talks to the engine."""

    begin: Callable[[], list | None] | None
    end: Callable[[dict | None], None] | None
    load: Callable[[Bucket], Callable[[], None]]

    @classmethod
    def of_engine(cls, engine) -> RolloutSide:
        """A rollout engine in this process (megarl.rollout: SGLangRolloutEngine, or one that loads what it is sent)."""
        def load(bucket: Bucket) -> Callable[[], None]:
            engine.update_weights(bucket)
            return lambda: None

        return cls(engine.begin_weight_update, engine.end_weight_update, load)


@dataclass(frozen=True)
class Sharding:
    """Sharded delivery from a generation TP `group` (a CPU process group of the ranks whose buckets are TP shards,
    keyed by `key`: sync_checks.shard_key). Every rank of it pushes, but only group rank 0 talks to the rollout engine
    (the others' RolloutSide has no begin and end) and broadcasts the endpoints; to SGLang the ranks then send
    together (cuda_ipc.ShardedIpcSender), and on a deep-verified sync rank 0 gathers every rank's host copies and
    hands `end` the whole tensors (sync_checks.DigestTee). To any other engine each rank loads its own buckets.
    With `replicas` (a CPU group of every generation TP group's ranks, the whole training world) each group posts
    its own rows to its own server, the `server`-th (the servers sit on the groups' GPUs in rank order: CUDA IPC
    stays on each group's node, so sharded delivery works with training ranks on several nodes): rank 0 broadcasts
    the endpoints over `replicas`, and every rank waits there once its group's posts are done, before rank 0 ends
    the sync. Rank 0's `group` alone verifies: its rows are every server's (the engine checks each server against
    them, so a group that delivered wrong rows is found)."""

    group: object
    key: Callable[[str], Key]
    replicas: object = None
    server: int = 0

    def share(self, endpoints: list | None, address: str) -> list | None:
        """Group rank 0's endpoints on every rank; with `replicas`, only this group's own server."""
        box = [endpoints]
        dist.broadcast_object_list(box, group_src=0, group=self.replicas if self.replicas is not None else self.group)
        endpoints = box[0]
        if self.replicas is not None and endpoints is not None:
            groups = dist.get_world_size(self.replicas) // dist.get_world_size(self.group)
            endpoints = [own_server(endpoints, self.server, groups, address)]
        return endpoints


class PolicySync:
    """One training rank's weight syncs (`push`), kept across syncs: one sender per set of server processes
    (weight_senders.sender_for: CUDA IPC's persistent buffers stay mapped in SGLang; NCCL's weight groups,
    rendezvousing at this rank's address, are built once); a new set of servers closes the old senders."""

    def __init__(self, weight_format: str = "persistent", master_address: str = "127.0.0.1",
                 serializer: Callable | None = None):
        self.settings = SenderSettings(weight_format, serializer, master_address)
        self.senders: dict[tuple, WeightSender] = {}

    def push(self, buckets: Iterable[Bucket], rollout: RolloutSide, verify: bool = False,
             expected: ExpectedChecksums | None = None, sharding: Sharding | None = None) -> SyncReport:
        """One sync of `buckets` into the engine `rollout` reaches. With `verify` and `expected`, the verification is
        by checksums (sync_checks.ChecksumTee: the report's `expected`); with `verify` alone, the deep check's host
        copies and digests (sync_checks.DigestTee: the report's `sent`)."""
        key = sharding.key if sharding is not None else _whole
        if verify and expected is not None:
            check = ChecksumTee(expected, key)
        elif verify:
            check = DigestTee(key, sharding.group if sharding is not None else None)
        else:
            check = Unchecked()
        return push_policy(buckets, rollout, self, check, sharding)

    def sender(self, endpoints: list | None, load: Callable, sharding: Sharding | None) -> WeightSender:
        if endpoints is None:
            return sender_for(None, self.settings, load)
        servers = tuple((e.url, e.instance, e.transport) for e in endpoints)
        if servers not in self.senders:  # a new set of servers: what the old senders set up is gone with them
            self.close()
            self.senders[servers] = sender_for(endpoints, self.settings, load,
                                               sharding.group if sharding is not None else None)
        return self.senders[servers]

    def close(self) -> None:
        """Release what the senders hold on both sides (NCCL weight groups, mapped buffers)."""
        for sender in self.senders.values():
            sender.close()
        self.senders.clear()


def _whole(name: str) -> Key:
    return name


class _Opening:
    """A sync's start: the engine's begin runs in a thread while the first bucket is gathered and converted (SGLang's
    taking its weights memory back overlaps that work); the first bucket's hand-over waits for it, and the endpoints
    it returned pick the sender."""

    def __init__(self, rollout: RolloutSide, sync: PolicySync, sharding: Sharding | None):
        self.rollout, self.sync, self.sharding = rollout, sync, sharding
        self.pool = ThreadPoolExecutor(1)
        self.begun = self.pool.submit(rollout.begin) if rollout.begin is not None else None
        self.chosen: WeightSender | None = None
        self.direct, self.begin_s = False, 0.0

    def sender(self) -> WeightSender:
        if self.chosen is None:
            t = time.perf_counter()
            endpoints = self.begun.result() if self.begun is not None else None
            if self.sharding is not None:
                endpoints = self.sharding.share(endpoints, self.sync.settings.master_address)
            self.begin_s = time.perf_counter() - t
            self.direct = endpoints is not None
            self.chosen = self.sync.sender(endpoints, self.rollout.load, self.sharding)
        return self.chosen

    def hand_over(self, bucket: Bucket, check: SyncCheck) -> Callable[[], None]:
        """The bucket to the sender (the first waits for the engine's begin), through the verification."""
        sender = self.sender()
        return check.send(sender, bucket, self.direct)


def push_policy(buckets: Iterable[Bucket], rollout: RolloutSide, sync: PolicySync, check: SyncCheck,
                sharding: Sharding | None = None) -> SyncReport:
    """One sync from a sending rank (PolicySync.push): the overlapped loop over the buckets (`send_overlapped`), each
    handed to the sender `sync` keeps through the sync's verification `check`, then the engine's end of the sync. A
    sync of no buckets still begins and ends."""
    start = time.perf_counter()
    check.begin()
    buckets = keep_fused_pairs(buckets)  # SGLang fuses DeepSeek's a-projections only when one load carries both
    opening = _Opening(rollout, sync, sharding)
    try:
        stats = send_overlapped(buckets, lambda bucket: opening.hand_over(bucket, check))
        opening.sender()
    finally:
        opening.pool.shutdown()
    check.sent()
    t = time.perf_counter()
    if sharding is not None and sharding.replicas is not None:  # every server holds its rows before rank 0 ends
        dist.barrier(group=sharding.replicas)
    if opening.direct and rollout.end is not None:
        with record_function("megarl.sync.end"):
            rollout.end(check.received())
    ended = time.perf_counter()
    report = SyncReport(bytes=stats["bytes"], direct=opening.direct, begin_s=opening.begin_s,
                        gather_convert_s=stats["produce_s"],
                        pack_s=stats["prepare_s"] - check.seconds - opening.begin_s, transfer_s=stats["wait_s"],
                        end_s=ended - t, posts_s=stats["posts_s"])
    check.result(report)
    report.digest_s = check.seconds + time.perf_counter() - ended
    report.seconds = time.perf_counter() - start
    return report


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


def own_server(endpoints: list, server: int, groups: int, address: str):
    """The endpoint generation TP group `server` posts to, of `groups` groups: one server each, on the group's node
    (a server elsewhere than this rank's `address` cannot map its CUDA IPC handles). Every rank checks the same
    list, so all fail alike."""
    if len(endpoints) != groups:
        raise WeightSyncError(f"sharded delivery posts each generation TP group's rows to its own server: {groups} "
                              f"groups of training ranks, {len(endpoints)} servers")
    endpoint = endpoints[server]
    host = urlparse(endpoint.url).hostname
    if host not in (address, "127.0.0.1", "localhost"):
        raise WeightSyncError(f"sharded delivery: server {endpoint.url} of generation TP group {server} is not on "
                              f"that group's node ({address}); its CUDA IPC handles cannot reach it")
    return endpoint


def verify(sent: dict[Key, tuple[torch.dtype, tuple]], received: dict[Key, tuple]) -> None:
    """Raise WeightSyncError naming every tensor whose received digest differs from the sent one."""
    missing = sorted(set(sent) - set(received), key=str)
    wrong = sorted((n for n in sent if n in received and received[n] != sent[n][1]), key=str)
    if missing or wrong:
        raise WeightSyncError(
            f"rollout weights differ from the trained policy after sync: "
            f"{len(wrong)} tensor(s) differ {wrong[:8]}, {len(missing)} missing {missing[:8]}")


def verify_checksums(expected: dict[tuple[int, str], tuple], held: dict[int, dict[int, dict[str, list]]],
                     buffers: dict | None = None, kept: tuple[str, ...] = ()) -> dict:
    """Raise WeightSyncError unless every server's every rank holds exactly the expected parameters.

    `expected`: (engine rank, parameter) -> (dtype, sum 0, sum 1), from the senders (weight_layout.merge);
    `held`: server -> rank -> parameter -> [dtype, shape, sum 0, sum 1, is_buffer], from the engine. A parameter
    the sync did not cover is an error (the layout missed it: its values are not the policy's), except under the
    `kept` name prefixes (a text-only policy's vision tower, which no sync sends: hf_config.TEXT_ONLY_TOWERS); those
    and a buffer it did not cover (a persistent buffer that is no weight) must keep the checksum they had at the
    first verification, `buffers` (returned, filled on the first call)."""
    buffers = {} if buffers is None else buffers
    wrong, missing, unsent = [], [], []
    for server, ranks in sorted(held.items()):
        for rank, params in sorted(ranks.items()):
            where = f"server {server} rank {rank}"
            for (r, name), (dtype, s0, s1) in expected.items():
                if r != rank:
                    continue
                got = params.get(name)
                if got is None:
                    missing.append(f"{where}: {name}")
                elif [got[0], *got[2:4]] != [dtype, s0, s1]:
                    wrong.append(f"{where}: {name}" + (f" ({got[0]}, sent {dtype})" if got[0] != dtype else ""))
            for name, (dtype, shape, s0, s1, buffer) in params.items():
                if (rank, name) in expected:
                    continue
                if not buffer and not name.startswith(kept):
                    unsent.append(f"{where}: {name}")
                elif buffers.setdefault((server, rank, name), (dtype, shape, s0, s1)) != (dtype, shape, s0, s1):
                    kind = "buffer" if buffer else "unsynced parameter"
                    wrong.append(f"{where}: {kind} {name} (changed since the first verification)")
    if wrong or missing or unsent:
        raise WeightSyncError(
            f"rollout weights differ from the trained policy after sync (checksums computed where the engine holds "
            f"them): {len(wrong)} differ {wrong[:8]}, {len(missing)} missing {missing[:8]}, {len(unsent)} held but "
            f"never sent {unsent[:8]}")
    return buffers


def traffic_metrics(traffic: list[dict | None]) -> dict[str, float]:
    """One sync's bytes per rank (TrainWorker.traffic, in rank order) beside the planner's for the same layouts
    (megarl.reshard.plan, `python -m megarl.plan`), as the planner reports them: the most any training rank received
    and sent resharding and the total received, the most and least any engine rank received; and
    sync/traffic_as_planned, 1 when every rank's every count is the planner's. Empty without the resharder."""
    if not traffic or any(t is None for t in traffic):
        return {}
    server = [b for t in traffic for b in t["server"]]
    planned_server = [b for t in traffic for b in t["plan_server"]]
    out = {}
    for prefix, recv, send, served in (("sync/", "recv", "send", server), ("sync/plan_", "plan_recv", "plan_send",
                                                                            planned_server)):
        out |= {f"{prefix}reshard_recv_max": max(t[recv] for t in traffic),
                f"{prefix}reshard_send_max": max(t[send] for t in traffic),
                f"{prefix}reshard_recv_total": sum(t[recv] for t in traffic),
                f"{prefix}server_recv_max": max(served, default=0), f"{prefix}server_recv_min": min(served, default=0)}
    as_planned = server == planned_server and all(t["recv"] == t["plan_recv"] and t["send"] == t["plan_send"]
                                                  for t in traffic)
    return out | {"sync/traffic_as_planned": float(as_planned)}
