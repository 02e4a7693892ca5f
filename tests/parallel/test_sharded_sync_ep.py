"""Sharded weight delivery from an expert-parallel policy, end to end on the CPU: a tiny Qwen3-MoE trained by GRPO at
EP=2 on two ranks (each holding half the experts), synced with rollout.weight_delivery=sharded at generation TP=2
into the hf rollout engine (megarl/rollout/hf.py's update_weight_shards: each generation rank's rows of every
tensor, expert rows pulled from the EP rank owning them by the resharder). The sync is verified by checksums after
every step, and the rollout engine ends up holding exactly the trained policy."""

import json


from megarl.config import load_config
from megarl.engine.weights import read_hf_config
from megarl.reshard.inventory import hf_inventory
from megarl.reshard.layout import GenLayout, TrainLayout
from megarl.reshard.plan import plan
from megarl.reshard.transfers import transfer_bytes
from megarl.trainer import RLTrainer
from megarl.workers import weight_sync
from tests.conftest import QUICKSTART as RECIPE
from tests.models.hf_families import qwen3_moe_config, save_random_for_recipe


def _moe_model(path) -> str:
    """A tiny random Qwen3-MoE (4 experts) with the character tokenizer the recipe's task uses."""
    return save_random_for_recipe(qwen3_moe_config(tied=False, norm_topk_prob=True, num_experts=4), path, seed=5)


def test_sharded_sync_from_an_ep2_policy_into_the_hf_engine(tmp_path, ray_local):
    import ray

    model = _moe_model(tmp_path / "moe")
    cfg = load_config(RECIPE, [
        f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}", "actor.parallel.world_size=2",
        "actor.parallel.tp=1", "actor.parallel.ep=2", "actor.micro_batch_size=8", "data.prompts_per_step=2",
        "rollout.n_samples=2", "data.val_size=2", "sft.steps=0", "trainer.steps=2", "trainer.eval_every=2",
        "reward.name=reverse", "trainer.loggers=jsonl", "rollout.weight_delivery=sharded", "rollout.sglang_tp=2",
        "trainer.verify_weight_sync_every=1"])
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        trainer.colocation.to_training()
        state = trainer.actor.call("hf_state_dict")[0]
        trainer.publish_policy()
        held = ray.get(trainer.rollout.weight_digests.remote({n: t.dtype for n, t in state.items()}))
    finally:
        trainer.shutdown()
    assert held == {n: weight_sync.tensor_digest(t) for n, t in state.items()}
    # what each step's sync moved into the engine: every generation rank's TP rows of every tensor, the planner's
    hf = read_hf_config(model)
    specs = hf_inventory(hf)
    shards = sum((hi - lo) * s.row_numel * 4 for s in specs for lo, hi in (s.rows(2, r) for r in range(2)))
    train = TrainLayout(1, 1, 2, hf["num_hidden_layers"], ep=2)
    expert_moves = sum(transfer_bytes([s for s in specs if s.expert is not None], train, GenLayout(2), "sharded", 4)[0])
    assert expert_moves > 0  # each rank's rows of the other EP rank's experts came from it
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in rows if "sync/bytes" in r]
    assert syncs and all(r["sync/bytes"] == shards for r in syncs), (syncs, shards)
    # each sync's bytes per rank, counted on the wire and posted, are the planner's (python -m megarl.plan)
    # (the planner prices bf16, this CPU policy is fp32: twice its bytes)
    planned = plan(hf, train, 2)["ranks"]
    for r in syncs:
        assert r["sync/traffic_as_planned"] == 1.0
        assert r["sync/reshard_recv_max"] == r["sync/plan_reshard_recv_max"] == 2 * max(x["sharded_recv"] for x in planned)
        assert r["sync/reshard_send_max"] == 2 * max(x["sharded_send"] for x in planned) > 0
        assert r["sync/server_recv_max"] + r["sync/server_recv_min"] == shards
        assert r["sync/server_recv_max"] == 2 * max(x["sharded_server_recv"] for x in planned)
