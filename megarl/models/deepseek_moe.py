"""DeepSeekMoE (DeepSeek-V3 and V2; GLM-4.5's, routed as V3's) on megatron's MoELayer: routed experts split over
EP (and within each EP rank over expert-TP, like Qwen3-MoE's), shared experts (one dense SwiGLU MLP of
moe_intermediate_size x n_shared_experts, split over TP, added to the routed output), and router.py's DeepSeekRouter,
which chooses the experts transformers chooses. megarl/models/deepseek.py and glm4_moe.py call the four functions
below for their MoE layers.

Settings megarl refuses by key, because the references disagree or transformers cannot run them:
  - moe_layer_freq != 1: transformers makes every layer from first_k_dense_replace on a MoE layer, DeepSeek's
    own code only every moe_layer_freq-th;
  - deepseek_v2 with norm_topk_prob=true: transformers ignores the key, DeepSeek's code and SGLang renormalise;
  - n_shared_experts null or 0: transformers adds the shared experts unconditionally;
  - scoring_func / topk_method other than the one transformers implements for the model_type (V3 and GLM-4.5:
    sigmoid and noaux_tc; V2: softmax and greedy or group_limited_greedy);
  - groups that cannot hold the choice (n_group not dividing n_routed_experts, topk_group > n_group, fewer
    experts in the kept groups than num_experts_per_tok, or, for V3 and GLM-4.5, groups of one expert: no top 2).
DeepSeek-V2's group_limited_greedy is routed as DeepSeek's code and SGLang route it (groups by their maximum);
transformers 5.12's DeepseekV2Moe raises AttributeError for it (its `num_experts` is never set).
Tokens reach the experts through megatron's allgather dispatcher (moe.py says why).
"""

from __future__ import annotations

from functools import partial

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.router import DeepSeekRouter, DeepSeekRouting
from megarl.models.sharding import WeightMap, gated_mlp, replicated

# model_type -> (its score function, the topk_method values transformers implements for it)
_ROUTING = {"deepseek_v3": ("sigmoid", ("noaux_tc",)), "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
            "glm4_moe": ("sigmoid", ("noaux_tc",))}
# model types whose MoE layers always hold e_score_correction_bias (transformers' DeepseekV3 and Glm4Moe MoE)
SCORE_BIAS = ("deepseek_v3", "glm4_moe")


def _require(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"{hf.get('model_type')} config.json needs {key!r} for its mixture-of-experts layers")
    return hf[key]


def is_moe_layer(hf: dict, layer: int) -> bool:
    """Layers first_k_dense_replace.. are MoE (every moe_layer_freq-th, which routing_rule requires to be 1)."""
    return layer >= hf.get("first_k_dense_replace", 0) and layer % hf.get("moe_layer_freq", 1) == 0


def routing_rule(hf: dict) -> DeepSeekRouting:
    """The router's rule from the HF config; settings that no reference runs the same way raise by key."""
    model_type = hf.get("model_type")
    if model_type == "kimi_k2":
        # Kimi-K2's published config.json: DeepseekV3ForCausalLM's weights under a model type only its remote code
        # reads (transformers and megarl's rollout engines read deepseek_v3's without it)
        raise ValueError("model_type='kimi_k2' is DeepSeek-V3's architecture (architectures: DeepseekV3ForCausalLM): "
                         "set \"model_type\": \"deepseek_v3\" in config.json; megarl reads it as DeepSeek-V3 then "
                         "(configs/models/kimi-k2.json is its shape)")
    if model_type not in _ROUTING:
        raise ValueError(f"model_type={model_type!r}: DeepSeekMoE serves {', '.join(_ROUTING)}")
    score_function, methods = _ROUTING[model_type]
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{model_type} with moe_layer_freq={hf['moe_layer_freq']} is not supported: transformers "
                         "ignores it (every layer from first_k_dense_replace on is MoE), DeepSeek's code does not")
    if not hf.get("n_shared_experts"):
        raise ValueError(f"{model_type} with n_shared_experts={hf.get('n_shared_experts')!r} is not supported: "
                         "transformers always adds the shared experts")
    if hf.get("scoring_func", score_function) != score_function:
        raise ValueError(f"{model_type} with scoring_func={hf['scoring_func']!r} is not supported: transformers "
                         f"routes {model_type} by {score_function} scores")
    method = hf.get("topk_method") or methods[0]
    if method not in methods:
        raise ValueError(f"{model_type} with topk_method={method!r} is not supported: expected "
                         f"{' or '.join(methods)}")
    norm_topk_prob = bool(_require(hf, "norm_topk_prob"))
    if model_type == "deepseek_v2" and norm_topk_prob:
        raise ValueError("deepseek_v2 with norm_topk_prob=true is not supported: transformers ignores the key, "
                         "DeepSeek's code and SGLang renormalise the top-k weights")
    experts, topk = _require(hf, "n_routed_experts"), _require(hf, "num_experts_per_tok")
    grouped = method != "greedy"
    num_groups = _require(hf, "n_group") if grouped else 1
    group_topk = _require(hf, "topk_group") if grouped else 1
    if grouped:
        if experts % num_groups or group_topk > num_groups:
            raise ValueError(f"{model_type} with n_group={num_groups}, topk_group={group_topk}: n_group must divide "
                             f"n_routed_experts={experts} and topk_group be at most n_group")
        per_group = experts // num_groups
        if topk > group_topk * per_group:
            raise ValueError(f"{model_type} with num_experts_per_tok={topk} > topk_group x experts per group = "
                             f"{group_topk} x {per_group}: the kept groups cannot hold the choice")
        if method == "noaux_tc" and per_group < 2:
            raise ValueError(f"{model_type} with n_group={num_groups} = n_routed_experts: a group is scored by its "
                             "top 2 experts and needs at least 2")
    return DeepSeekRouting(topk=topk, score_function=score_function,
                           group_score={"noaux_tc": "top2_sum", "group_limited_greedy": "max"}.get(method),
                           num_groups=num_groups, group_topk=group_topk, norm_topk_prob=norm_topk_prob,
                           scaling_factor=float(_require(hf, "routed_scaling_factor")),
                           # transformers' DeepseekV3 and Glm4Moe MoE always have e_score_correction_bias, whatever
                           # config.json says of topk_method (reshard/inventory.py's has_routing_bias: the same test)
                           score_bias=model_type in SCORE_BIAS)


def moe_config(hf: dict, ep: int) -> dict:
    """TransformerConfig fields of the MoE layers: routed and shared experts, the router's settings (those
    megatron has fields for; DeepSeekRouter does the choosing), allgather dispatch."""
    rule = routing_rule(hf)
    experts, width = hf["n_routed_experts"], _require(hf, "moe_intermediate_size")
    if experts % ep:
        raise ValueError(f"EP={ep} must divide the number of experts (n_routed_experts={experts})")
    groups = {}
    if rule.group_score:
        groups = dict(moe_router_num_groups=rule.num_groups, moe_router_group_topk=rule.group_topk)
    return dict(num_moe_experts=experts, moe_router_topk=rule.topk, moe_ffn_hidden_size=width,
                moe_shared_expert_intermediate_size=width * hf["n_shared_experts"],
                moe_router_score_function=rule.score_function, moe_router_pre_softmax=rule.score_function == "softmax",
                moe_router_topk_scaling_factor=rule.scaling_factor, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, **groups)


def moe_mlp_spec(hf: dict) -> ModuleSpec:
    """The `mlp` submodule spec of a MoE layer: megatron's local MoELayer (SequentialMLP experts, SharedExpertMLP)
    with DeepSeekRouter."""
    from megarl.parallel.compat import patch_moe_without_te

    patch_moe_without_te()
    spec = get_moe_module_spec(use_te=False, num_experts=hf["n_routed_experts"], moe_grouped_gemm=False)
    spec.submodules.router = partial(DeepSeekRouter, rule=routing_rule(hf))
    return spec


def moe_weight_maps(hf: dict, tp: int, layer: int) -> list[WeightMap]:
    """A MoE layer's router (and V3's bias), every routed expert by GLOBAL index (each EP rank holds a slice),
    and the shared experts."""
    m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    maps = [WeightMap(m + "router.weight", (h + "gate.weight",), **replicated())]
    if routing_rule(hf).score_bias:
        maps.append(WeightMap(m + "router.expert_bias", (h + "gate.e_score_correction_bias",), **replicated()))
    for e in range(hf["n_routed_experts"]):
        maps += gated_mlp(m + f"experts.local_experts.{e}.", h + f"experts.{e}.")
    return maps + gated_mlp(m + "shared_experts.", h + "shared_experts.")
