"""Weight delivery from a DeepSeek-V3-shaped policy trained at TP=1 x EP=2 (two gloo ranks, each holding half the
routed experts, bf16 as on GPU) into one colocated SGLang server of TP=2: the fake server's DeepSeek ranks
(tests/rollout/fake_sglang_deepseek.py: SGLang 0.5.17's placement and loading, written from its source), at
--ep-size 1 (every rank holds its TP rows of every expert) and --ep-size 2 (each rank whole experts of its EP slice).
Sharded delivery: the resharder moves the expert rows a rank lacks from the EP rank owning them, each rank posts
exactly its SGLang rank's shard (cuda_ipc.ShardedIpcSender; pickled tensors in place of IPC handles), loaded
presharded. Full delivery: rank 0 posts whole tensors, each SGLang rank keeps its part. After every sync:
- each SGLang rank holds bitwise what SGLang's own loader keeps of the HF tensors (the HF tensor's slice);
- checksums computed inside the server equal the senders' (megarl.rollout.weight_layout at --ep-size), and a bit
  flipped in an expert's weights after loading is named;
- the bytes each rank received and sent resharding, and posted to its SGLang rank, are the planner's
  (megarl.reshard.plan, bf16: the engine's dtype here)."""

import json
from pathlib import Path

import requests

from megarl.reshard.inventory import hf_inventory
from megarl.reshard.plan import plan
from megarl.rollout.transports import cuda_ipc
from megarl.workers import weight_sync
from megarl.workers.sync_checks import WeightSyncError, shard_key
from tests.dist_utils import run_distributed
from tests.models.hf_families import deepseek_v3_config, save_random
from tests.rollout import fake_sglang
from tests.rollout.fake_sglang_deepseek import DeepseekRank

BUCKET = 48 << 10  # several buckets per sync
CASES = ((1, ("sharded",)), (2, ("sharded", "full")))  # SGLang's --ep-size, the deliveries into that server
W13 = "model.layers.1.mlp.experts.w13_weight"


def _not_through_the_actor(bucket):
    raise AssertionError("a sync into SGLang must not load buckets through the rollout actor")


def _sglang_holds(hf: dict, full: dict, ep: int) -> list[dict]:
    """Digests of what each SGLang TP rank keeps when its own loader reads the whole HF tensors."""
    out = []
    for rank in range(2):
        model = DeepseekRank(hf, rank, 2, ep=ep)
        model.load_weights(full.items())
        out.append({n: fake_sglang.digest(t) for n, t in model.named_parameters()})
    return out


def _rank(rank, model_dir, work):
    import pytest
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
    from megarl.engine import MegatronEngine
    from megarl.reshard.layout import resharded_layout, sglang_generation
    from megarl.reshard.resharder import engine_resharder
    from megarl.rollout.sglang import SGLangRolloutEngine
    from megarl.rollout.weight_layout import ExpectedChecksums, layout_for, merge
    from tests.rollout.test_sglang_engine import fake_server

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    engine = MegatronEngine(model_dir, ActorConfig(parallel=ParallelConfig(world_size=2, ep=2), precision="bf16"),
                            AlgorithmConfig(), "cpu", 1, 10)
    resharder = engine_resharder(engine, rank)
    assert (resharder.train.tp, resharder.train.ep) == (1, 2)
    group = dist.new_group([0, 1], backend="gloo")
    hf = json.loads(Path(model_dir, "config.json").read_text())
    specs = hf_inventory(hf)
    full = {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}  # collective
    for ep, deliveries in CASES:
        args = ["--ep-size", str(ep)] if ep > 1 else []
        served = sglang_generation(2, args)
        planned = plan(hf, resharder.train, served)["ranks"][rank]
        layout = layout_for(specs, "sglang", 2, hf=hf, sglang_args=args)
        rollout = None
        if rank == 0:
            rollout = SGLangRolloutEngine(model_dir, colocated=True, verify_dir=str(Path(work, "verify")),
                                          serializer=cuda_ipc.plain_serializer, launch=lambda i: fake_server(
                                              Path(work), "--tp", "2", "--model-path", model_dir, *args, tp=2))
        syncs = weight_sync.PolicySync(serializer=cuda_ipc.plain_serializer)
        for delivery in deliveries:
            where, sharded = f"--ep-size {ep}, {delivery} delivery", delivery == "sharded"
            gen = resharded_layout(served, delivery)
            buckets = resharder.buckets(gen, delivery, BUCKET, engine.params_dtype)
            if sharded or rank == 0:
                expected = ExpectedChecksums(layout, [rank], presharded=True) if sharded else \
                    ExpectedChecksums(layout, [0, 1])
                side = weight_sync.RolloutSide(rollout.begin_weight_update if rank == 0 else None,
                                               rollout.end_weight_update if rank == 0 else None, _not_through_the_actor)
                sharding = weight_sync.Sharding(group, shard_key(specs, gen, rank)) if sharded else None
                report = syncs.push(buckets, side, True, expected=expected, sharding=sharding)
                assert report.direct and report.bytes == planned[f"{delivery}_server_recv"], where
                if sharded:  # its own SGLang rank's experts only, whole at --ep-size 2
                    experts = {int(n.split(".")[5]) for n in _sent_names(expected) if ".mlp.experts." in n}
                    assert experts == (set(range(8)) if ep == 1 else set(range(4 * rank, 4 * rank + 4))), where
            else:
                for _ in buckets:  # rank 1 in full delivery: its part of the gathers only
                    pass
            # the resharder's bytes on the wire, and what went to SGLang, are the planner's
            assert (resharder.received_bytes, resharder.sent_bytes) == (planned[f"{delivery}_recv"],
                                                                        planned[f"{delivery}_send"]), where
            parts = [None, None] if rank == 0 else None
            dist.gather_object(expected.result() if sharded or rank == 0 else {}, parts, group_dst=0)
            if rank == 0:
                server = rollout.servers[0]
                held = [requests.get(f"{server.url}/fake/weights?rank={r}", timeout=5).json() for r in range(2)]
                assert held == _sglang_holds(hf, full, ep), where
                checksums = merge(parts)
                weight_sync.verify_checksums(checksums, rollout.weight_checksums())
                if ep == 2 and sharded:
                    rollout.corrupt_weight(W13, rank=1)  # a bit flipped in SGLang's memory after loading
                    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank 1: {W13}'\]"):
                        weight_sync.verify_checksums(checksums, rollout.weight_checksums())
            if sharded:  # every rank of the group (full delivery's sender is closed with its server, below)
                syncs.close()
        if rank == 0:
            syncs.close()
            rollout.shutdown()
        dist.barrier()
    return True


def _sent_names(expected) -> set[str]:
    """The HF tensors a sender's ExpectedChecksums was given (its planned keys)."""
    return {key if isinstance(key, str) else key[0] for key in expected.plans}


def test_both_deliveries_from_an_ep2_policy_into_a_tp2_sglang_server_at_ep_size_1_and_2(tmp_path):
    model_dir = save_random(deepseek_v3_config(layers=2, first_k_dense_replace=1, vocab_size=128),
                            tmp_path / "deepseek_v3", seed=6)
    assert run_distributed(_rank, 2, model_dir, str(tmp_path), timeout=240)
