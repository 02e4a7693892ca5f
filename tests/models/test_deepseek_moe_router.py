"""megarl's DeepSeekRouter against transformers' own DeepSeek MoE routing (DeepseekV3MoE.route_tokens_to_experts,
DeepseekV2Moe.route_tokens_to_experts) on random router logits: the same experts for every token and the same
weights (fp32), for settings where megatron-core's group-limited top-k would choose differently."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from megarl.models.deepseek_moe import moe_config, moe_mlp_spec, routing_rule

TOKENS = 512
SMALL = dict(hidden_size=16, num_attention_heads=2, moe_intermediate_size=8, n_shared_experts=1)
# name -> (config class, MoE class, settings)
SETTINGS = {
    # topk 3 != 2 x topk_group 4: megatron would score groups by their top 1
    "v3-k3-groups4-keep2": (DeepseekV3Config, DeepseekV3MoE, dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                                                 topk_group=2, norm_topk_prob=True,
                                                                 routed_scaling_factor=2.5)),
    # topk 5, 3 groups of 4 keeping 2; unnormalised weights
    "v3-k5-groups3-keep2": (DeepseekV3Config, DeepseekV3MoE, dict(n_routed_experts=12, num_experts_per_tok=5,
                                                                 n_group=3, topk_group=2, norm_topk_prob=False,
                                                                 routed_scaling_factor=1.5)),
    # topk = 2 x topk_group (megatron's rule agrees here) and one group
    "v3-k4-groups4-keep2": (DeepseekV3Config, DeepseekV3MoE, dict(n_routed_experts=16, num_experts_per_tok=4,
                                                                 n_group=4, topk_group=2, norm_topk_prob=True,
                                                                 routed_scaling_factor=1.0)),
    "v3-k2-one-group": (DeepseekV3Config, DeepseekV3MoE, dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                                             topk_group=1, norm_topk_prob=True,
                                                             routed_scaling_factor=2.5)),
    # groups by their maximum, topk 4 = 2 x topk_group (megatron would score groups by the sum of their top 2)
    "v2-group-limited-k4": (DeepseekV2Config, DeepseekV2Moe, dict(n_routed_experts=8, num_experts_per_tok=4,
                                                                 n_group=4, topk_group=2,
                                                                 topk_method="group_limited_greedy",
                                                                 routed_scaling_factor=1.0)),
    "v2-group-limited-k3": (DeepseekV2Config, DeepseekV2Moe, dict(n_routed_experts=12, num_experts_per_tok=3,
                                                                 n_group=6, topk_group=3,
                                                                 topk_method="group_limited_greedy",
                                                                 routed_scaling_factor=16.0)),
    "v2-greedy": (DeepseekV2Config, DeepseekV2Moe, dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                                       topk_group=2, topk_method="greedy",
                                                       routed_scaling_factor=1.0)),
}


def _hf_dict(hf_config) -> dict:
    return hf_config.to_dict()  # what config.json holds


def _megarl_router(hf: dict):
    from megarl.parallel.compat import patch_moe_without_te

    patch_moe_without_te()
    config = TransformerConfig(num_layers=1, hidden_size=hf["hidden_size"], num_attention_heads=2,
                               use_cpu_initialization=True, **moe_config(hf, ep=1))
    groups = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    return moe_mlp_spec(hf).submodules.router(config=config, pg_collection=groups)


def _dense(indices: torch.Tensor, weights: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(len(indices), experts).scatter(1, indices, weights)


def _hf_routing(moe, logits):
    if isinstance(moe, DeepseekV2Moe):
        moe.num_experts = moe.config.n_routed_experts  # transformers 5.12 never sets it (AttributeError)
        return moe.route_tokens_to_experts(logits.view(1, *logits.shape))
    return moe.route_tokens_to_experts(logits)


@pytest.mark.parametrize("name", SETTINGS)
def test_router_chooses_the_experts_and_weights_transformers_chooses(name):
    config_class, moe_class, settings = SETTINGS[name]
    hf_config = config_class(**SMALL, **settings)
    experts = settings["n_routed_experts"]
    torch.manual_seed(0)
    moe = moe_class(hf_config)
    router = _megarl_router(_hf_dict(hf_config))
    if isinstance(moe, DeepseekV3MoE):
        bias = 0.3 * torch.randn(experts)  # as large as the score differences: it changes the choice
        moe.gate.e_score_correction_bias.copy_(bias)
        router.expert_bias.data.copy_(bias)
    logits = 2.0 * torch.randn(TOKENS, experts)

    with torch.no_grad():
        hf_indices, hf_weights = _hf_routing(moe, logits)
        probs, routing_map = router.routing(logits)

    hf_map = _dense(hf_indices, torch.ones_like(hf_weights), experts).bool()
    assert torch.equal(routing_map, hf_map), name
    torch.testing.assert_close(probs, _dense(hf_indices, hf_weights, experts), rtol=0, atol=1e-6)
    assert torch.equal(router.last_topk_indices.sort(1).values, hf_indices.sort(1).values)
    assert router.tokens_per_expert.sum() == 0  # counted only in training forwards (with grad)


def test_megatron_group_limited_topk_differs_where_topk_is_not_twice_topk_group():
    """Why DeepSeekRouter exists: megatron-core's own routing on the same scores chooses other experts."""
    _, _, settings = SETTINGS["v3-k3-groups4-keep2"]
    hf_config = DeepseekV3Config(**SMALL, **settings)
    torch.manual_seed(0)
    moe = DeepseekV3MoE(hf_config)
    logits = 2.0 * torch.randn(TOKENS, settings["n_routed_experts"])
    hf_indices, _ = moe.route_tokens_to_experts(logits)
    _, megatron_map = topk_routing_with_score_function(logits, 3, num_groups=4, group_topk=2,
                                                       score_function="sigmoid",
                                                       expert_bias=moe.gate.e_score_correction_bias)
    hf_map = _dense(hf_indices, torch.ones(hf_indices.shape), 8).bool()
    assert (megatron_map != hf_map).any(dim=1).sum() > TOKENS // 20


def test_training_forward_counts_tokens_per_expert():
    _, _, settings = SETTINGS["v2-greedy"]
    router = _megarl_router(_hf_dict(DeepseekV2Config(**SMALL, **settings)))
    logits = torch.randn(TOKENS, 8, requires_grad=True)
    _, routing_map = router.routing(logits)
    assert torch.equal(router.tokens_per_expert, routing_map.sum(0))
    assert router.tokens_per_expert.sum() == 2 * TOKENS


@pytest.mark.parametrize("change, key", [
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(norm_topk_prob=True), "norm_topk_prob"),
    (dict(n_shared_experts=None), "n_shared_experts"),
    (dict(topk_method="noaux_tc"), "topk_method"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(topk_method="group_limited_greedy", n_group=3), "n_group"),
    (dict(topk_method="group_limited_greedy", num_experts_per_tok=5, topk_group=2), "num_experts_per_tok"),
])
def test_settings_no_reference_runs_the_same_way_are_refused_by_key(change, key):
    _, _, settings = SETTINGS["v2-greedy"]
    hf = _hf_dict(DeepseekV2Config(**SMALL, **settings)) | change
    with pytest.raises(ValueError, match=key):
        routing_rule(hf)


def test_deepseek_v3_groups_of_one_expert_are_refused():
    _, _, settings = SETTINGS["v3-k2-one-group"]
    hf = _hf_dict(DeepseekV3Config(**SMALL, **settings)) | dict(n_group=8, topk_group=4)
    with pytest.raises(ValueError, match="top 2"):
        routing_rule(hf)


def test_kimi_k2_model_type_names_the_deepseek_v3_edit():
    _, _, settings = SETTINGS["v3-k2-one-group"]
    hf = _hf_dict(DeepseekV3Config(**SMALL, **settings)) | {"model_type": "kimi_k2"}
    with pytest.raises(ValueError, match='set "model_type": "deepseek_v3" in config.json'):
        routing_rule(hf)
    routing_rule(hf | {"model_type": "deepseek_v3"})


@pytest.mark.parametrize("name, refused", [("v3-k3-groups4-keep2", False), ("v2-greedy", True)])
def test_bias_update_needs_deepseek_v3_sigmoid_routing(name, refused):
    from megarl.models.router import expert_bias_update_options

    config_class, _, settings = SETTINGS[name]
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               **moe_config(_hf_dict(config_class(**SMALL, **settings)), ep=1))
    if refused:
        with pytest.raises(ValueError, match="actor.moe_router_bias_update_rate"):
            expert_bias_update_options(config, 1e-3)
    else:
        with pytest.raises(ValueError, match="actor.moe_router_bias_update_rate=-0.001"):
            expert_bias_update_options(config, -1e-3)
        assert expert_bias_update_options(config, 1e-3) == dict(moe_router_enable_expert_bias=True,
                                                                 moe_router_bias_update_rate=1e-3)


def test_bias_stays_fp32_when_the_model_is_cast_to_bf16():
    """Float16Module casts the model to bf16: the routing bias keeps its fp32 values (exported, synced and
    checksummed as the checkpoint holds it); the load counts stay integers."""
    _, _, settings = SETTINGS["v3-k3-groups4-keep2"]
    router = _megarl_router(_hf_dict(DeepseekV3Config(**SMALL, **settings)))
    bias = torch.randn(8) / 3
    router.expert_bias.data.copy_(bias)
    router.bfloat16()
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, bias)
    assert router.tokens_per_expert.dtype == torch.long


def test_megatron_routing_replay_records_and_replays_deepseek_choices():
    """megatron's routing replay (moe_enable_routing_replay) stands in for DeepSeek's choice: recorded on one
    forward, replayed on another whose scores would choose differently; the weights are the new scores'."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    _, _, settings = SETTINGS["v3-k3-groups4-keep2"]
    hf = _hf_dict(DeepseekV3Config(**SMALL, **settings))
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               moe_enable_routing_replay=True, **moe_config(hf, ep=1))
    router = moe_mlp_spec(hf).submodules.router(config=config, pg_collection=SimpleNamespace(
        tp=None, cp=None, tp_cp=None, tp_dp_cp=None))
    try:
        recorded_logits, other_logits = 2.0 * torch.randn(2, TOKENS, 8)
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            _, recorded_map = router.routing(recorded_logits)
            router.router_replay.set_target_indices(router.router_replay.get_recorded_indices())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            probs, replayed_map = router.routing(other_logits)
            router.router_replay.clear_router_replay_action()
            _, own_map = router.routing(other_logits)
        assert torch.equal(replayed_map, recorded_map) and not torch.equal(own_map, recorded_map)
        chosen = torch.sigmoid(other_logits).masked_fill(~recorded_map, 0)
        torch.testing.assert_close(probs, 2.5 * chosen / chosen.sum(-1, keepdim=True), rtol=0, atol=1e-6)
    finally:
        RouterReplay.clear_global_router_replay_instances()
