"""GRPO end to end on the CPU with a tiny random DeepSeek-V3 policy (a dense layer, then a MoE layer: 8 routed experts,
a shared expert, sigmoid routing with a random e_score_correction_bias) trained at EP=2 on two ranks (each holding
half the experts), the transformers rollout engine generating, the aux-loss-free bias update on: each step logs the
per-expert load, the weights synced into the rollout engine are verified by checksums after every step, and the
engine ends up holding exactly the trained policy, the moved routing bias included."""

import torch
from safetensors.torch import load_file

from megarl.workers import sync_checks
from tests.models.family_grpo import grpo_then_weights
from tests.models.hf_families import deepseek_v3_config, save_random_for_recipe

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _deepseek_model(path) -> str:
    """A tiny random DeepSeek-V3 with the character tokenizer the recipe's task uses."""
    return save_random_for_recipe(deepseek_v3_config(layers=2, first_k_dense_replace=1), path, seed=11)


def test_grpo_with_a_deepseek_v3_policy_at_ep2(tmp_path, ray_local):
    model = _deepseek_model(tmp_path / "deepseek")
    state, held, steps = grpo_then_weights(model, tmp_path / "run", [
        "actor.parallel.ep=2", "actor.micro_batch_size=8", "actor.moe_router_bias_update_rate=0.01"])

    assert held == {n: sync_checks.tensor_digest(t) for n, t in state.items()}
    assert not torch.equal(state[BIAS], load_file(f"{model}/model.safetensors")[BIAS])  # moved, and synced
    assert len(steps) == 2 and all(r["sync/verified"] == 1.0 for r in steps)
    for r in steps:
        load = [r[f"train/expert_load/layer_1/expert_{e}"] for e in range(8)]
        assert sum(load) > 0 and sum(load) % 3 == 0  # each token routed to num_experts_per_tok = 3 experts
