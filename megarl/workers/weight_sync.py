"""Moving the policy from the training ranks into a rollout engine, and proving it arrived intact.

A sending training rank streams buckets out of the resharder (megarl.reshard) with
`push_policy`. The rollout engine picks the transport when the sync begins: SGLang hands out its
endpoints and the rank sends each bucket itself (this process owns the tensors, so they never leave the
GPU on the way), by CUDA IPC to colocated servers (transports/cuda_ipc.py) or by NCCL broadcast to servers
on GPUs of their own (transports/nccl_broadcast.py); any other engine loads each bucket in the rollout actor
(through Ray's object store: `RolloutEngine.update_weights`, or a generation TP rank's rows,
`update_weight_shards`). Either way bucket k is in flight while bucket k+1 is gathered and converted.

Verification (trainer.verify_weight_sync_every), by default by checksums: the sending rank computes, bucket by
bucket on its device, what every parameter the engine holds must hash to (megarl.rollout.weight_layout: SGLang's
fused, sharded, padded parameters from the HF tensors sent; by the same kernel pass that packs the bucket), and
the engine computes the same checksums of the parameters as it holds them, where they live (inside SGLang's TP
workers, cuda_ipc.inspect_weights), asked for after the sync, off its path: the trainer collects them before it
trains on anything those weights generated (RLTrainer.check_rollout_weights; generation only reads the weights,
so the sums are those of the memory the sync wrote), and `verify_checksums` compares the two and names
every parameter that differs, is missing, or was never sent. No copy of the weights leaves either GPU.
The deep check (trainer.verify_weight_sync_deep) instead keeps host copies of what was sent, has SGLang reload
them from a file with its own loader and compare, then digests the engine's weights against the sender's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megarl.reshard.layout import as_generation
from megarl.rollout.transports import cuda_ipc, nccl_broadcast
from megarl.rollout.weight_layout import ExpectedChecksums, keep_fused_pairs
from megarl.utils.checksum import checksums


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


Bucket = list[tuple[str, torch.Tensor]]


def make_sender(endpoints: list, weight_format: str, serializer: Callable | None, master_address: str, group=None):
    """The sender for the endpoints' transport. NCCL sends the flat layout of the CUDA IPC formats (one
    broadcast per bucket) or, with "tensors", one broadcast per tensor. With a generation TP `group` (sharded
    delivery) its ranks send their shards together by CUDA IPC (persistent buffers)."""
    if group is not None:
        return cuda_ipc.ShardedIpcSender(endpoints, group, serializer)
    ipc = [e for e in endpoints if e.transport == "cuda_ipc"]
    nccl = [e for e in endpoints if e.transport == "nccl"]
    broadcast = nccl_broadcast.NcclSender(nccl, master_address, flattened=weight_format != "tensors") if nccl else None
    posting = cuda_ipc.CudaIpcSender(ipc, weight_format, serializer) if ipc else None
    return SplitSender(posting, broadcast) if posting and broadcast else posting or broadcast


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


def close_senders(senders: dict) -> None:
    """Release what the senders hold on both sides (NCCL weight groups); the dict is left empty."""
    for sender in senders.values():
        sender.close()
    senders.clear()


def push_policy(buckets: Iterable[Bucket], begin: Callable[[], list | None], end: Callable[[dict | None], None],
                load: Callable[[Bucket], Callable[[], None]], verify: bool, key: Callable[[str], Key] = lambda n: n,
                weight_format: str = "persistent", senders: dict | None = None,
                serializer: Callable | None = None, master_address: str = "127.0.0.1", group=None,
                expected: ExpectedChecksums | None = None, replicas=None, server: int = 0) -> dict:
    """One sync from a sending rank. `begin()` starts it on the rollout engine and returns SGLang endpoints
    (the buckets are sent from here by the endpoints' transport, then `end(received)` closes the sync;
    `received` are host copies of what was sent, for SGLang's own check, on a verified sync) or None
    (`load(bucket)` hands each bucket to the rollout actor now and returns the wait for it). `senders` keeps
    one sender per set of server processes across syncs (make_sender: CUDA IPC's persistent buffers stay
    mapped in SGLang; NCCL's weight groups, rendezvousing at `master_address`, this rank's address, are
    built once).

    `begin()` runs in a thread while the first bucket is gathered and converted (SGLang's taking its weights
    memory back overlaps that work); the first bucket's hand-over waits for it.

    Sharded delivery from a generation TP `group` (a CPU process group of the ranks whose buckets are TP shards):
    every rank of it calls this, but only group rank 0 talks to the rollout engine (the others pass begin and end
    as None) and broadcasts the endpoints; to SGLang the ranks then send together (cuda_ipc.ShardedIpcSender), and
    on a verified sync rank 0 gathers every rank's host copies (per bucket) and hands `end` the whole tensors
    (`assemble`).
    To any other engine each rank loads its own buckets.
    With `replicas` (a CPU group of every generation TP group's ranks, the whole training world) each group posts
    its own rows to its own server, the `server`-th (the servers sit on the groups' GPUs in rank order: CUDA IPC
    stays on each group's node, so sharded delivery works with training ranks on several nodes): rank 0 broadcasts
    the endpoints over `replicas`, and every rank waits there once its group's posts are done, before rank 0 ends
    the sync. Rank 0's `group` alone verifies: its rows are every server's (the engine checks each server against
    them, so a group that delivered wrong rows is found).

    With `verify` and `expected`, the verification is by checksums: each tensor sent goes into `expected` (by
    `key(name)`), summed where the sender packs the bucket by the pack's own copy (CUDA IPC), and nothing else is
    kept (the engine's weight_checksums, later, takes SGLang's); with `verify` alone, the deep check's host
    copies and digests.
    `expected` is kept across syncs (its plans and table): each sync begins it, and queues its read-back once the
    last bucket is sent, so the host waits for the sums only in its result, after `end`.

    Returns what was sent (deep check: dtype and digest per tensor, by `key(name)`; checksums: `expected`'s
    result), the bf16/fp32 bytes
    sent, and seconds: total on this rank (begin to end), and its split (the wait for begin, gather/convert,
    pack, transfer wait, end, digests), and each bucket's post (posts_s)."""
    start = time.perf_counter()
    if verify and expected is not None:
        expected.begin()  # one ExpectedChecksums serves every sync (its plans and table are kept)
    buckets = keep_fused_pairs(buckets)  # SGLang fuses DeepSeek's a-projections only when one load carries both
    pool = ThreadPoolExecutor(1)
    begun = pool.submit(begin) if begin is not None else None
    senders = {} if senders is None else senders
    sent, sums, received, digest_s, begin_wait = [], [], {}, 0.0, 0.0
    shards = []  # sharded into SGLang, verified, on group rank 0: every rank's host copies, bucket by bucket
    first = group is None or dist.get_group_rank(group, dist.get_rank()) == 0
    endpoints, deliver = None, None

    def transport() -> Callable[[Bucket], Callable[[], None]]:
        nonlocal endpoints, begin_wait
        t = time.perf_counter()
        endpoints = begun.result() if begun is not None else None
        if replicas is not None or group is not None:
            box = [endpoints]
            dist.broadcast_object_list(box, group_src=0, group=replicas if replicas is not None else group)
            endpoints = box[0]
        if replicas is not None and endpoints is not None:
            endpoints = [own_server(endpoints, server, dist.get_world_size(replicas) // dist.get_world_size(group),
                                    master_address)]
        begin_wait = time.perf_counter() - t
        if endpoints is None:  # the rollout actor loads each bucket: its engine's checksums come when asked
            def hand_over(bucket: Bucket, table) -> Callable[[], None]:
                return load(bucket)

            return hand_over
        servers = tuple((e.url, e.instance, e.transport) for e in endpoints)
        if servers not in senders:  # a new set of servers: what the old senders set up is gone with them
            close_senders(senders)
            senders[servers] = make_sender(endpoints, weight_format, serializer, master_address, group)
        sender = senders[servers]
        return lambda bucket, table: sender.send(bucket, checksums=table)

    def prepare(bucket: Bucket) -> Callable[[], None]:
        nonlocal digest_s, deliver
        deliver = deliver or transport()
        table = None
        if verify and expected is not None:  # queued here, summed by the sender's pack in its pass over the bucket
            t = time.perf_counter()
            with record_function("megarl.sync.expected_add"):
                for n, x in bucket:
                    expected.add(key(n), x)
            table = expected.table
            digest_s += time.perf_counter() - t
        with record_function("megarl.sync.pack"):
            post = deliver(bucket, table)
        if table is not None:
            expected.flush()  # what the sender did not sum: the bucket's memory is reused once it is sent
        elif verify:
            t = time.perf_counter()
            sent.extend((key(n), x.dtype, x.shape) for n, x in bucket)  # not the tensors: one bucket in memory
            sums.extend(checksums([x for _, x in bucket]))  # queued on the device behind the pack
            if endpoints is not None:
                copies = {key(n): x.detach().to("cpu", copy=True) for n, x in bucket}
                if group is None:
                    received.update(copies)
                else:  # every bucket's at once: rank 0's staging of the gather stays within a bucket
                    parts = [None] * dist.get_world_size(group) if first else None
                    dist.gather_object(copies, parts, group_dst=0, group=group)
                    shards.extend(parts or [])
            digest_s += time.perf_counter() - t
        return post

    try:
        stats = cuda_ipc.send_overlapped(buckets, prepare)
        deliver = deliver or transport()  # a sync of no buckets still begins and ends
    finally:
        pool.shutdown()
    if verify and expected is not None:
        expected.fetch()  # the sums' read-back is queued now and waited for in result(), after `end`
    t = time.perf_counter()
    if replicas is not None:  # every server holds its rows before rank 0 ends the sync
        dist.barrier(group=replicas)
    if endpoints is not None and group is not None and verify and expected is None and first:
        received = assemble(shards)
    if endpoints is not None and end is not None:
        with record_function("megarl.sync.end"):
            end(received if verify else None)
    ended = time.perf_counter()
    done = fingerprints([(dtype, shape) for _, dtype, shape in sent], sums)
    report = {"sent": {k: (dtype, d) for (k, dtype, _), d in zip(sent, done)}, "bytes": stats["bytes"],
              "direct": endpoints is not None, "begin_s": begin_wait, "gather_convert_s": stats["produce_s"],
              "pack_s": stats["prepare_s"] - digest_s - begin_wait, "transfer_s": stats["wait_s"], "end_s": ended - t,
              "posts_s": stats["posts_s"]}
    if verify and expected is not None:
        with record_function("megarl.sync.expected_result"):
            report["expected"] = expected.result()
    report["digest_s"] = digest_s + time.perf_counter() - ended
    report["seconds"] = time.perf_counter() - start
    return report


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


def verify(sent: dict[Key, tuple[torch.dtype, tuple]], received: dict[Key, tuple]) -> None:
    """Raise WeightSyncError naming every tensor whose received digest differs from the sent one."""
    missing = sorted(set(sent) - set(received), key=str)
    wrong = sorted((n for n in sent if n in received and received[n] != sent[n][1]), key=str)
    if missing or wrong:
        raise WeightSyncError(
            f"rollout weights differ from the trained policy after sync: "
            f"{len(wrong)} tensor(s) differ {wrong[:8]}, {len(missing)} missing {missing[:8]}")


def verify_checksums(expected: dict[tuple[int, str], tuple], held: dict[int, dict[int, dict[str, list]]],
                     buffers: dict | None = None) -> dict:
    """Raise WeightSyncError unless every server's every rank holds exactly the expected parameters.

    `expected`: (engine rank, parameter) -> (dtype, sum 0, sum 1), from the senders (weight_layout.merge);
    `held`: server -> rank -> parameter -> [dtype, shape, sum 0, sum 1, is_buffer], from the engine. A parameter
    the sync did not cover is an error (the layout missed it: its values are not the policy's); a buffer it did
    not cover (a persistent buffer that is no weight) must keep the checksum it had at the first verification,
    `buffers` (returned, filled on the first call)."""
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
                if not buffer:
                    unsent.append(f"{where}: {name}")
                elif buffers.setdefault((server, rank, name), (dtype, shape, s0, s1)) != (dtype, shape, s0, s1):
                    wrong.append(f"{where}: buffer {name} (changed since the first verification)")
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
