"""Sharded ("zero-redundancy") weight delivery into a colocated SGLang server of TP=2, on the CPU: a TP=2 megatron
policy on 2 gloo ranks, each sending its own TP shard (cuda_ipc.ShardedIpcSender; pickled tensors in place of IPC
handles), into the fake SGLang server's two TP ranks, which load with SGLang's presharded semantics
(tests/rollout/fake_sglang.py tp_model)."""

import json
from pathlib import Path

import pytest
import requests
import torch

from megarl.reshard.inventory import hf_inventory
from megarl.rollout import sglang_layout
from megarl.rollout.transports import cuda_ipc, flat_bucket, sglang_loader
from megarl.workers import weight_sync
from megarl.workers.sync_checks import WeightSyncError, assemble, digests_of, shard_key
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_distinct_qwen2_dir
from tests.rollout import fake_sglang

BUCKET = 24 << 10  # several buckets per sync: both persistent slots are reused
Q = "model.layers.0.self_attn.q_proj.weight"


def _hf(model_dir) -> dict:
    return json.loads(Path(model_dir, "config.json").read_text())


def _sglang_shards(hf: dict, full: dict) -> list[dict]:
    """What each SGLang TP rank must hold: the full tensors loaded by the fake's own (SGLang's) narrowing."""
    out = []
    for rank in range(2):
        model = fake_sglang.tp_model(hf, rank, 2)
        model.load_weights(full.items())
        out.append({n: fake_sglang.digest(t) for n, t in model.weights.items()})
    return out


def _held(server) -> list[dict]:
    return [requests.get(f"{server.url}/fake/weights?rank={r}", timeout=5).json() for r in range(2)]


def _mapped(server) -> list[int]:
    return requests.get(server.url + "/fake/mapped", timeout=5).json()


def _not_through_the_actor(bucket):
    raise AssertionError("a sharded sync into SGLang must not load buckets through the rollout actor")


def _rank(rank, model_dir, work):
    import torch.distributed as dist

    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.engine import MegatronEngine
    from megarl.engine.weights import global_parameters
    from megarl.reshard.layout import TrainLayout
    from megarl.reshard.resharder import engine_resharder
    from megarl.reshard.plan import plan
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.sglang_server import Endpoint, SGLangError
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for, merge
    from tests.rollout.test_sglang_engine import configure, fake_server, log

    engine = MegatronEngine(model_dir, ActorConfig(), AlgorithmConfig(), "cpu", 1, 10)
    resharder = engine_resharder(engine, rank)
    group = dist.new_group([0, 1], backend="gloo")
    hf = _hf(model_dir)
    itemsize = torch.empty((), dtype=engine.params_dtype).element_size()
    planned = plan(hf, TrainLayout(2, 1, 1, hf["num_hidden_layers"]), 2)["ranks"][rank]["gen_weights"] * itemsize // 2
    rollout = None
    if rank == 0:
        rollout = SGLangRolloutEngine(model_dir, colocated=True, verify_dir=str(Path(work, "verify")),
                                      serializer=cuda_ipc.plain_serializer, launch=lambda i:
                                      fake_server(Path(work), "--tp", "2", "--model-path", model_dir, tp=2))
    syncs = weight_sync.PolicySync(serializer=cuda_ipc.plain_serializer)

    def sync(verify: bool, checksums: bool = False) -> dict:
        """Deep check: what was sent, gathered on rank 0; checksums: the senders' expected checksums, merged."""
        talks = rank == 0
        expected = ExpectedChecksums(layout_for(resharder.specs, "sglang", 2), [rank], True) if checksums else None
        side = weight_sync.RolloutSide(rollout.begin_weight_update if talks else None,
                                       rollout.end_weight_update if talks else None, _not_through_the_actor)
        sharding = weight_sync.Sharding(group, shard_key(resharder.specs, 2, rank))
        report = syncs.push(resharder.buckets(2, "sharded", BUCKET, engine.params_dtype), side, verify,
                            expected=expected, sharding=sharding)
        assert report.direct and report.bytes == planned, (rank, report.bytes, planned)
        sent = [None, None] if talks else None
        dist.gather_object(report.expected if checksums else report.sent, sent, group_dst=0)
        if checksums:
            return merge(sent) if talks else None
        return {k: v for part in sent for k, v in part.items()} if talks else None

    def weight_posts() -> int | None:  # weight requests into the server so far (rank 0 talks to it)
        return len(log(rollout.servers[0], "/update_weights_from_tensor")) if rank == 0 else None

    def policy() -> dict:  # megatron's own gather of the policy (collective)
        return {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}

    try:
        full = policy()
        sent = sync(verify=True)
        if rank == 0:
            server = rollout.servers[0]
            posts = log(server, "/update_weights_from_tensor")
            assert len(posts) > 2 and {p["body"]["load_format"] for p in posts} == {sglang_loader.PERSISTENT_LOADER}
            assert _held(server) == _sglang_shards(hf, full)  # each rank holds exactly SGLang's shard, bitwise
            received = rollout.named_weights()  # SGLang's own check: its shards against its loader on the full file
            assert received.keys() == full.keys() and all(torch.equal(received[n], full[n]) for n in full)
            dtypes = {k: d for k, (d, _) in sent.items()}
            assert (Q, 0, 32, 64) in sent and "model.norm.weight" in sent
            weight_sync.verify(sent, digests_of(received, dtypes))  # the trainer's digest check
            received[Q][40, 3] += 1  # rank 1's rows of q_proj differ from what rank 1 sent
            with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) differ \[\('" + Q + r"', 0, 32, 64\)"):
                weight_sync.verify(sent, digests_of(received, dtypes))
        with torch.no_grad():  # a new policy: the second sync reuses both slots with other values
            for p in global_parameters(engine.gpt).values():
                p.add_(1)
        full = policy()
        before = weight_posts()
        sync(verify=False)
        plain = weight_posts() - before if rank == 0 else None
        if rank == 0:
            assert _held(rollout.servers[0]) == _sglang_shards(hf, full)
            assert len(syncs.senders) == 1 and rollout.received == {}
            configure(rollout.servers[0], corrupt=[1, Q])  # SGLang's rank 1 holds a wrong shard
        for wrong in (Endpoint("http://127.0.0.1:1", tp=1), Endpoint("http://127.0.0.1:1", tp=2, transport="nccl")):
            with pytest.raises(ValueError, match=r"cannot take the shards of a 2-rank group by CUDA IPC: it needs "
                                                 r"colocated servers of TP=2"):
                cuda_ipc.ShardedIpcSender([wrong], group, cuda_ipc.plain_serializer)
        sync(verify=True)
        if rank == 0:
            with pytest.raises(SGLangError, match=f"check tensor equality failed: \\['rank 1 {Q}'\\]"):
                rollout.named_weights()
            assert _mapped(rollout.servers[0]) == [0, 1]
        # the default verification: checksums inside SGLang's TP workers against the senders' (fused q/k/v, gate/up,
        # padded vocabulary: the fake's SGLang view); the corrupted shard of rank 1 is named by SGLang's parameter
        QKV = "model.layers.0.self_attn.qkv_proj.weight"
        expected = sync(verify=True, checksums=True)
        if rank == 0:
            with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank 1: {QKV}'\]"):
                weight_sync.verify_checksums(expected, rollout.weight_checksums())
            configure(rollout.servers[0], corrupt=None)
        before = weight_posts()
        expected = sync(verify=True, checksums=True)
        if rank == 0:
            # as many requests as the unverified sync's: SGLang sums nothing until the collection below asks
            assert weight_posts() - before == plain and list(rollout.servers[0].checksum_dir.iterdir()) == []
            weight_sync.verify_checksums(expected, rollout.weight_checksums())
            rollout.corrupt_weight("model.norm.weight", rank=0)  # a bit flipped in SGLang's memory after loading
            with pytest.raises(WeightSyncError, match=r"1 differ \['server 0 rank 0: model.norm.weight'\]"):
                weight_sync.verify_checksums(expected, rollout.weight_checksums())
        syncs.close()  # on every rank: SGLang lets go of both ranks' buffers, then they are freed
        if rank == 0:
            assert _mapped(rollout.servers[0]) == []
    finally:
        if rollout is not None:
            rollout.shutdown()
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_distinct_qwen2_dir(tmp_path_factory.mktemp("sharded") / "qwen2", vocab_size=256, layers=2, heads=4, kv_heads=2)


def test_sharded_sync_into_a_tp2_sglang_server(model_dir, tmp_path):
    assert run_distributed(_rank, 2, model_dir, str(tmp_path), tp=2, timeout=180)


def test_presharded_loader_switches_the_models_layers_and_restores_them(model_dir):
    hf = _hf(model_dir)
    full = {n: torch.randn(s.shape) for n, s in ((s.name, s) for s in hf_inventory(hf))}
    reference = fake_sglang.tp_model(hf, 1, 2)
    reference.load_weights(full.items())  # narrowed from full tensors: SGLang's default loading
    model = fake_sglang.tp_model(hf, 1, 2)
    model.row.use_presharded_weights = True  # a layer built presharded stays so
    seen = []
    load_weights = model.load_weights
    model.load_weights = lambda named: (seen.append([m.use_presharded_weights for m in (model.column, model.vocab)]),
                                        load_weights(named))
    sglang_loader.load_presharded(model, list(reference.weights.items()))
    assert seen == [[True, True]] and [model.column.use_presharded_weights, model.row.use_presharded_weights,
                                       model.vocab.use_presharded_weights] == [False, True, False]
    assert all(torch.equal(model.weights[n], t) for n, t in reference.weights.items())
    wrong = [(n, t) for n, t in reference.weights.items() if n != Q] + [(Q, reference.weights[Q][:-1])]
    with pytest.raises(RuntimeError, match=f"presharded weight load failed at {Q} \\(rows of shape \\[31, 64\\]\\)"):
        sglang_loader.load_presharded(model, wrong)
    assert [model.column.use_presharded_weights, model.row.use_presharded_weights,
            model.vocab.use_presharded_weights] == [False, True, False]  # restored after the failure too
    with pytest.raises(RuntimeError, match="presharded weight load failed at model.embed_tokens.weight.*"
                                           "org_vocab_size=256 self.use_presharded_weights=True"):
        sglang_loader.load_presharded(model, [("model.embed_tokens.weight", full["model.embed_tokens.weight"])])
    # the persistent loader takes the same path for a "presharded" header
    layout, size = flat_bucket.flat_layout(list(reference.weights.items()))
    flat = flat_bucket.pack(list(reference.weights.items()), torch.empty(size, dtype=torch.uint8))
    fresh = fake_sglang.tp_model(hf, 1, 2)
    sglang_loader.load_flat_bucket(fresh, [(json.dumps({"slot": 0, "layout": layout, "presharded": True}),
                                      flat)])
    assert all(torch.equal(fresh.weights[n], t) for n, t in reference.weights.items())


def test_sglang_vocab_rows_are_checked_before_sending():
    from megarl.reshard.inventory import TensorSpec

    for vocab in (256, 151936, 152064):  # multiples of 64 and of TP: megarl's rows are SGLang's
        sglang_layout.check_presharded_vocab([TensorSpec("lm_head.weight", (vocab, 8), 0, None, pad_vocab=True)], 2)
    with pytest.raises(ValueError, match=r"lm_head.weight: vocabulary of 101 rows at TP=2: SGLang's presharded loading "
                                         r"takes rows \[0, 64\] on rank 0 and needs 50"):
        sglang_layout.check_presharded_vocab([TensorSpec("lm_head.weight", (101, 8), 0, None, pad_vocab=True)], 2)
    with pytest.raises(ValueError, match=r"vocabulary of 200 rows at TP=2.*multiple of 64 and of TP"):
        sglang_layout.check_presharded_vocab([TensorSpec("model.embed_tokens.weight", (200, 8), 0, None,
                                                         pad_vocab=True)], 2)


def test_assemble_tiles_row_blocks_and_refuses_gaps():
    a, b = torch.arange(6.0).view(3, 2), torch.arange(6.0, 10.0).view(2, 2)
    whole = assemble([{("w", 0, 0, 3): a, "n": torch.ones(2), ("k", 1, 0, 1): b[:, :1]},
                                  {("w", 0, 3, 5): b, "n": torch.zeros(2), ("k", 1, 0, 1): b[:, :1]}])
    assert torch.equal(whole["w"], torch.arange(10.0).view(5, 2)) and torch.equal(whole["n"], torch.ones(2))
    assert torch.equal(whole["k"], b[:, :1])  # a block two ranks hold (K/V heads at TP above their count), once
    with pytest.raises(WeightSyncError, match=r"w: the generation TP ranks' row blocks \[\(0, 3\), \(4, 5\)\]"):
        assemble([{("w", 0, 0, 3): a}, {("w", 0, 4, 5): b[:1]}])


def _rank_per_group(rank, model_dir, work):
    """Training TP=2 x DP=2 on 4 ranks, two colocated servers of TP=2: generation TP group k (ranks 2k, 2k+1)
    posts its own rows to server k (push_policy's `replicas`), the first group's rows verify both servers."""
    import torch.distributed as dist

    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.engine import MegatronEngine
    from megarl.reshard.layout import TrainLayout, new_generation_group
    from megarl.reshard.plan import plan
    from megarl.reshard.resharder import engine_resharder
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for, merge
    from tests.rollout.test_sglang_engine import fake_server, log

    engine = MegatronEngine(model_dir, ActorConfig(), AlgorithmConfig(), "cpu", 1, 10)
    resharder = engine_resharder(engine, rank)
    group = new_generation_group(resharder.train, 2, backend="gloo")
    replicas = dist.new_group(backend="gloo")
    hf = _hf(model_dir)
    itemsize = torch.empty((), dtype=engine.params_dtype).element_size()
    layout = TrainLayout(2, 1, 2, hf["num_hidden_layers"])
    planned = plan(hf, layout, 2)["ranks"][rank]["gen_weights"] * itemsize // 2
    rollout = None
    if rank == 0:
        rollout = SGLangRolloutEngine(model_dir, num_servers=2, colocated=True, serializer=cuda_ipc.plain_serializer,
                                      launch=lambda i: fake_server(Path(work), "--tp", "2", "--model-path", model_dir,
                                                                   tp=2))
    syncs, first = weight_sync.PolicySync(serializer=cuda_ipc.plain_serializer), rank < 2
    try:
        full = {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
        expected = ExpectedChecksums(layout_for(resharder.specs, "sglang", 2), [rank], True) if first else None
        before = [len(log(server, "/update_weights_from_tensor")) for server in rollout.servers] if rollout else None
        side = weight_sync.RolloutSide(rollout.begin_weight_update if rank == 0 else None,
                                       rollout.end_weight_update if rank == 0 else None, _not_through_the_actor)
        sharding = weight_sync.Sharding(group, shard_key(resharder.specs, 2, rank), replicas, server=rank // 2)
        report = syncs.push(resharder.buckets(2, "sharded", BUCKET, engine.params_dtype), side, first,
                            expected=expected, sharding=sharding)
        assert report.direct and report.bytes == planned, (rank, report.bytes, planned)
        posts = [None] * 4 if rank == 0 else None  # each group's first rank posted every bucket, the others none
        dist.gather_object(len(report.posts_s) if rank % 2 == 0 else 0, posts, group_dst=0)
        sums = [None] * 4 if rank == 0 else None
        dist.gather_object(report.expected, sums, group_dst=0)
        if rank == 0:
            buckets = posts[0]
            assert buckets > 2 and posts == [buckets, 0, buckets, 0]
            # each server is reached by its own group's sender alone: the buckets, and a release where a bucket
            # outgrew its slot (whether one lands before this count varies), fewer than two senders would make
            got = [len(log(server, "/update_weights_from_tensor")) - earlier for server, earlier in zip(rollout.servers,
                                                                                                        before)]
            assert all(buckets <= n < 2 * buckets for n in got), (got, buckets)
            for server in rollout.servers:  # and holds SGLang's shards bitwise
                assert _held(server) == _sglang_shards(hf, full)
            expected = merge(sums[:2])
            weight_sync.verify_checksums(expected, rollout.weight_checksums())  # both servers against group 0's rows
            rollout.corrupt_weight("model.norm.weight", rank=1, server=1)
            with pytest.raises(WeightSyncError, match=r"1 differ \['server 1 rank 1: model.norm.weight'\]"):
                weight_sync.verify_checksums(expected, rollout.weight_checksums())
        syncs.close()  # every rank: each server lets go of its group's buffers
        if rank == 0:
            assert [_mapped(server) for server in rollout.servers] == [[], []]
    finally:
        if rollout is not None:
            rollout.shutdown()
    return True


def test_each_generation_tp_group_posts_its_own_rows_to_its_own_server(model_dir, tmp_path):
    assert run_distributed(_rank_per_group, 4, model_dir, str(tmp_path), tp=2, timeout=240)


def test_a_group_is_refused_a_server_it_cannot_reach():
    from megarl.rollout.sglang_server import Endpoint

    here, there = Endpoint("http://10.0.0.1:30000", tp=2), Endpoint("http://10.0.0.2:30000", tp=2)
    assert weight_sync.own_server([here, there], 0, 2, "10.0.0.1") is here
    with pytest.raises(WeightSyncError, match=r"server http://10.0.0.2:30000 of generation TP group 1 is "
                                                           r"not on that group's node \(10.0.0.9\)"):
        weight_sync.own_server([here, there], 1, 2, "10.0.0.9")
    with pytest.raises(WeightSyncError, match="its own server: 3 groups of training ranks, 2 servers"):
        weight_sync.own_server([here, there], 0, 3, "10.0.0.1")
