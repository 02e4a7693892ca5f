import functools
import time

import pytest
import requests
import torch

from megarl.rollout.transports import cuda_ipc
from megarl.utils.checksum import checksums
from megarl.workers.sync_checks import WeightSyncError, digests_of, tensor_digest
from megarl.workers.weight_sync import PolicySync, RolloutSide, verify

from tests.rollout import fake_sglang
from tests.rollout.test_sglang_engine import bucket_of, engine, log


def test_device_digest_is_bitwise_and_dtype_aware():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float64, torch.uint8):
        a = (torch.randn(37, 11, generator=g) * 50).to(dtype)
        b = a.clone()
        assert tensor_digest(a) == tensor_digest(b)
        for i in (0, 200, a.numel() - 1):  # one element, anywhere, one step of its bits
            c = a.clone()
            bits = c.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()])
            bits[i] ^= 1
            assert tensor_digest(c) != tensor_digest(a), (dtype, i)
        swapped = a.clone().view(-1)
        swapped[[3, 4]] = swapped[[4, 3]]
        assert swapped[3] == swapped[4] or tensor_digest(swapped.view(37, 11)) != tensor_digest(a)
        assert tensor_digest(a) != tensor_digest(a.view(11, 37))  # shape counts
    half = torch.randn(64, generator=g, dtype=torch.float16)
    assert tensor_digest(half) != tensor_digest(half.view(torch.bfloat16))  # same bits, other dtype
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))
    # sums do not depend on how the reduction is cut up (GPU and CPU agree), nor on memory layout
    t = torch.randn(1000, generator=g)
    assert torch.equal(checksums([t])[0], checksums([t.view(10, 100)])[0])
    m = torch.randn(20, 30, generator=g)
    assert tensor_digest(m.t()) == tensor_digest(m.t().contiguous())


def test_push_then_verify_against_the_receivers_own_copy():
    weights = {"w1": torch.randn(3, 3), "w2": torch.randn(7)}
    held = {}

    def load(bucket):
        held.update({n: t.clone() for n, t in bucket})
        return lambda: None

    actor = RolloutSide(begin=lambda: None, end=None, load=load)
    report = PolicySync().push([[("w1", weights["w1"])], [("w2", weights["w2"])]], actor, verify=True)
    assert report.bytes == (9 + 7) * 4 and not report.direct
    dtypes = {n: d for n, (d, _) in report.sent.items()}
    verify(report.sent, digests_of(held, dtypes))

    held["w2"][4] += 1e-3  # the receiver holds something else than what was sent
    with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) differ \['w2'\]"):
        verify(report.sent, digests_of(held, dtypes))
    del held["w1"]
    with pytest.raises(WeightSyncError, match=r"1 missing \['w1'\]"):
        verify(report.sent, digests_of(held, dtypes))
    unverified = PolicySync().push([[("w1", weights["w1"])]], actor, verify=False)
    assert unverified.sent == {} and unverified.expected is None and unverified.bytes == 36


def test_begin_overlaps_the_first_buckets_production_and_failures_surface():
    events = []

    def begin():
        time.sleep(0.3)  # SGLang taking its weights memory back
        events.append("begun")

    def buckets():
        events.append("producing bucket 0")
        time.sleep(0.2)  # gather and convert
        yield [("w", torch.ones(2))]

    report = PolicySync().push(buckets(), RolloutSide(begin, None, load=lambda b: lambda: events.append("loaded")))
    assert events == ["producing bucket 0", "begun", "loaded"]  # produced while begin ran, loaded after it
    assert 0.0 < report.begin_s < 0.2  # the part of begin not hidden (~0.1 s)

    def gone():
        raise RuntimeError("server gone")

    with pytest.raises(RuntimeError, match="server gone"):  # even a sync of no buckets waits for begin
        PolicySync().push(iter([]), RolloutSide(gone, None, load=None))


@pytest.mark.parametrize("fmt", ["tensors", "persistent"])
def test_direct_sync_posts_from_the_sending_process(tmp_path, fmt):
    """The direct path the trainer takes with SGLang, against fake SGLang (CPU: pickled tensors in place of
    IPC handles): begin hands out endpoints, this process posts every bucket, end closes the sync; the
    engine keeps host copies only for a verified sync, and the next sync is a new weight version."""
    e = engine(tmp_path, colocated=True)
    try:
        server, syncs = e.servers[0], PolicySync(fmt, serializer=cuda_ipc.plain_serializer)
        not_here = functools.partial(pytest.fail, "a direct sync must not load buckets through the rollout actor")
        for sync, check in enumerate((True, False)):
            buckets = [bucket_of(10 * sync + k) for k in range(3)]
            report = syncs.push(iter(buckets), RolloutSide(e.begin_weight_update, e.end_weight_update, not_here), check)
            assert report.direct and e.version == sync + 1 and not e.syncing
            held = requests.get(server.url + "/fake/weights", timeout=5).json()
            assert {n: h[2] for n, h in held.items()} == {n: fake_sglang.digest(t)[2] for n, t in buckets[-1]}
            assert report.bytes == 3 * (24 * 2 + 4 * 4 + 9 * 2)
            assert (len(e.received), len(report.sent)) == ((3, 3) if check else (0, 0))
            if check:  # what SGLang got, what the engine kept and what was sent all agree
                last = dict(buckets[-1])
                verify({n: v for n, v in report.sent.items() if n in last},
                       digests_of(e.received, {n: t.dtype for n, t in last.items()}))
        assert len(syncs.senders) == 1  # one sender across syncs: the persistent buffers stay mapped
    finally:
        e.shutdown()


@pytest.mark.parametrize("fmt", ["tensors", "persistent"])
def test_disaggregated_sync_broadcasts_to_every_server_over_one_group_each(tmp_path, fmt):
    """The trainer's path to servers on GPUs of their own, against two fake SGLang servers (gloo on CPU tensors
    in place of NCCL): begin names the transport, the first bucket builds one weight group per server, every
    bucket reaches every server bit for bit (one flat buffer per bucket, or one broadcast per tensor), the
    groups serve the next sync too, and closing the senders destroys both halves."""
    e = engine(tmp_path, servers=2, colocated=False)
    try:
        syncs = PolicySync(fmt)
        not_here = functools.partial(pytest.fail, "a direct sync must not load buckets through the rollout actor")
        for sync, check in enumerate((True, False)):
            buckets = [bucket_of(10 * sync + k) for k in range(3)]
            report = syncs.push(iter(buckets), RolloutSide(e.begin_weight_update, e.end_weight_update, not_here), check)
            assert report.direct and e.version == sync + 1 and not e.syncing
            expected = {n: fake_sglang.digest(t) for n, t in buckets[-1]}
            for server in e.servers:
                assert requests.get(server.url + "/fake/weights", timeout=5).json() == expected
            assert (len(e.received), len(report.sent)) == ((3, 3) if check else (0, 0))
        (sender,) = syncs.senders.values()
        assert len(sender.groups) == 2 and {g.group_name for g in sender.groups} == {
            b["body"]["group_name"] for s in e.servers for b in log(s, "/init_weights_update_group")}
        for server in e.servers:
            (joined,) = log(server, "/init_weights_update_group")  # once, for both syncs
            assert joined["body"] | {"master_port": 0, "group_name": ""} == {
                "master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2,
                "group_name": "", "backend": "gloo"}
            posts = log(server, "/update_weights_from_distributed")
            assert len(posts) == 6 and {p["body"]["load_format"] for p in posts} == {
                None if fmt == "tensors" else "flattened_bucket"}
            assert posts[0]["body"]["dtypes"] == ["bfloat16", "float32", "bfloat16"]
        syncs.close()
        assert syncs.senders == {} and all(len(log(s, "/destroy_weights_update_group")) == 1 for s in e.servers)
    finally:
        e.shutdown()


def test_verified_sync_leaves_sglangs_checksums_to_a_later_request(tmp_path):
    """The default verification into a colocated server (persistent format): the sync asks SGLang for nothing
    (one request per bucket, no file); one request later has its TP worker checksum what it holds. A bit flipped
    after the sync is named by the next request."""
    from megarl.reshard.inventory import TensorSpec
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
    from megarl.workers.weight_sync import verify_checksums

    tensors = bucket_of(3)
    layout = layout_for([TensorSpec(n, tuple(t.shape), None, None) for n, t in tensors], "hf")
    e = engine(tmp_path, colocated=True, serializer=cuda_ipc.plain_serializer)
    try:
        server, syncs = e.servers[0], PolicySync("persistent", serializer=cuda_ipc.plain_serializer)
        not_here = functools.partial(pytest.fail, "a direct sync must not load buckets through the rollout actor")
        side = RolloutSide(e.begin_weight_update, e.end_weight_update, not_here)
        report = syncs.push(iter([[t] for t in tensors]), side, True, expected=ExpectedChecksums(layout, [0]))
        assert len(log(server, "/update_weights_from_tensor")) == 3  # one request per bucket, nothing more
        assert server.checksum_dir is None or list(server.checksum_dir.iterdir()) == []  # SGLang summed nothing yet
        verify_checksums(report.expected, e.weight_checksums())
        assert len(log(server, "/update_weights_from_tensor")) == 4  # the collection
        name = tensors[0][0]
        e.corrupt_weight(name)  # memory corrupted after the sync
        with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank 0: {name}'\]"):
            verify_checksums(report.expected, e.weight_checksums())
        assert len(log(server, "/update_weights_from_tensor")) == 6  # the flip, and a request for the checksums
        syncs.push(iter([tensors]), side, False)
        verify_checksums(report.expected, e.weight_checksums())  # unverified: asked now, of the weights it loaded
        syncs.close()
    finally:
        e.shutdown()


def test_the_sender_is_chosen_by_the_engines_answer_and_the_servers_placement():
    """weight_senders.sender_for: no endpoints, the rollout actor loads (its wait is the post); colocated servers by
    CUDA IPC, disaggregated ones by NCCL (flat buckets unless the format sends tensors), both kinds split between the
    two senders, each with its own servers."""
    from types import SimpleNamespace

    from megarl.rollout.transports.cuda_ipc import CudaIpcSender
    from megarl.rollout.transports.nccl_broadcast import NcclSender
    from megarl.workers.weight_senders import ActorLoadSender, SenderSettings, SplitSender, sender_for

    loaded = []
    how = SenderSettings("persistent", cuda_ipc.plain_serializer, "10.0.0.1")
    actor = sender_for(None, how, lambda bucket: loaded.append(bucket) or (lambda: loaded.append("waited")))
    assert isinstance(actor, ActorLoadSender)
    actor.send([("w", torch.ones(1))])()
    assert [b if b == "waited" else [n for n, _ in b] for b in loaded] == [["w"], "waited"]
    ipc, nccl = SimpleNamespace(transport="cuda_ipc", tp=1), SimpleNamespace(transport="nccl", tp=1)
    colocated = sender_for([ipc], how, None)
    assert type(colocated) is CudaIpcSender and colocated.endpoints == [ipc] and colocated.fmt == "persistent"
    disaggregated = sender_for([nccl], how, None)
    assert type(disaggregated) is NcclSender and disaggregated.flattened and disaggregated.master_address == "10.0.0.1"
    assert not sender_for([nccl], SenderSettings("tensors"), None).flattened
    split = sender_for([nccl, ipc], how, None)
    assert isinstance(split, SplitSender) and split.posting.endpoints == [ipc] and split.broadcast.endpoints == [nccl]
