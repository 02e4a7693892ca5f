"""GRPO end to end on the CPU with a tiny random DeepSeek-V3 policy (a dense layer, then a MoE layer: 8 routed experts,
a shared expert, sigmoid routing with a random e_score_correction_bias) trained at EP=2 on two ranks (each holding
half the experts), the transformers rollout engine generating, the aux-loss-free bias update on: each step logs the
per-expert load, the weights synced into the rollout engine are verified by checksums after every step, and the
engine ends up holding exactly the trained policy, the moved routing bias included."""

import json

import torch
from safetensors.torch import load_file

from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from megarl.workers import sync_checks
from tests.conftest import QUICKSTART as RECIPE
from tests.models.hf_families import deepseek_v3_config, save_random_for_recipe

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _deepseek_model(path) -> str:
    """A tiny random DeepSeek-V3 with the character tokenizer the recipe's task uses."""
    return save_random_for_recipe(deepseek_v3_config(layers=2, first_k_dense_replace=1), path, seed=11)


def test_grpo_with_a_deepseek_v3_policy_at_ep2(tmp_path, ray_local):
    import ray

    model = _deepseek_model(tmp_path / "deepseek")
    cfg = tiny_config([
        f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}", "actor.parallel.world_size=2",
        "actor.parallel.tp=1", "actor.parallel.ep=2", "actor.micro_batch_size=8",
        "actor.moe_router_bias_update_rate=0.01", "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2", "sft.steps=0", "trainer.steps=2",
        "trainer.eval_every=2", "reward.name=reverse", "trainer.loggers=jsonl", "trainer.verify_weight_sync_every=1"], path=RECIPE)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        trainer.colocation.to_training()
        state = trainer.actor.call("hf_state_dict")[0]
        trainer.publish_policy()
        held = ray.get(trainer.rollout.weight_digests.remote({n: t.dtype for n, t in state.items()}))
    finally:
        trainer.shutdown()

    assert held == {n: sync_checks.tensor_digest(t) for n, t in state.items()}
    assert not torch.equal(state[BIAS], load_file(f"{model}/model.safetensors")[BIAS])  # moved, and synced
    rows = [json.loads(line) for line in (run_dir(tmp_path / "run") / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(r["sync/verified"] == 1.0 for r in steps)
    for r in steps:
        load = [r[f"train/expert_load/layer_1/expert_{e}"] for e in range(8)]
        assert sum(load) > 0 and sum(load) % 3 == 0  # each token routed to num_experts_per_tok = 3 experts
