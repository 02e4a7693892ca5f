"""DeepSeek's expert routing on megatron's TopKRouter: the experts and weights transformers' DeepseekV3MoE and
DeepseekV2Moe choose, for every setting of their keys.

  DeepSeek-V3 (noaux_tc): s = sigmoid(logits); the experts are chosen on s + e_score_correction_bias, their
      weights taken from s alone; experts come in n_group groups, a group scored by the sum of its top 2
      (biased) scores, the best topk_group groups kept; norm_topk_prob renormalises the chosen weights.
  DeepSeek-V2: s = softmax(logits); greedy top-k, or group_limited_greedy (a group scored by its maximum).
  Both: the weights times routed_scaling_factor.
megatron-core's own group-limited top-k scores a group by the sum of its top (topk / topk_group) experts, which is
DeepSeek-V3's rule only when topk = 2 x topk_group (and V2's only when topk < 2 x topk_group), and its sigmoid
path always renormalises; DeepSeekRouter replaces the choice and keeps everything else of TopKRouter (gating in
fp32, megatron's routing replay hook, the aux-loss-free bias update in finalize_model_grads).

The bias: `expert_bias`, a parameter that takes no gradient (the optimizer and DDP skip it), so it is loaded
from and exported to the checkpoint's e_score_correction_bias, offloaded and snapshotted with the weights.
With actor.moe_router_bias_update_rate > 0 megatron moves it after each update (expert_bias_update_options).

Per token and per layer, the router keeps what it chose: `last_topk_indices` ([tokens, topk] global expert ids,
tokens in the layer's own order, sequence-major) for a later routing replay, and `tokens_per_expert` counts the
tokens routed to each expert in training forwards (padding rows included: it is the experts' compute load) until
expert_load_metrics reads and resets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor


@dataclass(frozen=True)
class DeepSeekRouting:
    """One MoE layer's routing rule (deepseek_moe.routing_rule reads it from the HF config)."""
    topk: int
    score_function: str        # "sigmoid" (V3) or "softmax" (V2)
    group_score: str | None    # "top2_sum" (V3), "max" (V2 group_limited_greedy) or None (no groups)
    num_groups: int
    group_topk: int
    norm_topk_prob: bool
    scaling_factor: float
    score_bias: bool           # V3's e_score_correction_bias, added to the scores for choosing only


def routing_scores(logits: Tensor, rule: DeepSeekRouting) -> Tensor:
    """[tokens, experts] fp32 scores, as transformers computes them from the fp32 router logits."""
    if rule.score_function == "sigmoid":
        return logits.float().sigmoid()
    return logits.softmax(dim=-1, dtype=torch.float32)


def choose_experts(scores: Tensor, rule: DeepSeekRouting, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """(the chosen experts' unbiased scores, their indices), both [tokens, topk], in transformers' order."""
    for_choice = scores if bias is None else scores + bias
    if rule.group_score is not None:
        tokens, experts = for_choice.shape
        grouped = for_choice.view(tokens, rule.num_groups, experts // rule.num_groups)
        if rule.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        groups = torch.topk(group_scores, k=rule.group_topk, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        kept = kept.unsqueeze(-1).expand(tokens, rule.num_groups, experts // rule.num_groups).reshape(tokens, -1)
        for_choice = for_choice.masked_fill(~kept, float("-inf"))
    indices = torch.topk(for_choice, k=rule.topk, dim=-1, sorted=False)[1]
    return scores.gather(1, indices), indices


def expert_weights(chosen_scores: Tensor, rule: DeepSeekRouting) -> Tensor:
    """The chosen experts' output weights: renormalised if norm_topk_prob, times routed_scaling_factor."""
    if rule.norm_topk_prob:
        chosen_scores = chosen_scores / (chosen_scores.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen_scores * rule.scaling_factor


class DeepSeekRouter(TopKRouter):
    """megatron's TopKRouter with DeepSeek's choice of experts (MoESubmodules.router; deepseek_moe.moe_mlp_spec)."""

    def __init__(self, config, pg_collection=None, *, rule: DeepSeekRouting):
        super().__init__(config=config, pg_collection=pg_collection)
        self.rule = rule
        if self.enable_expert_bias and not rule.score_bias:
            raise ValueError("the aux-loss-free bias update (actor.moe_router_bias_update_rate) needs a router "
                             "with e_score_correction_bias (DeepSeek-V3's noaux_tc)")
        if rule.score_bias:
            # TopKRouter registers expert_bias as a buffer only when the bias update is on; a frozen parameter in
            # either case, so the weight maps carry it like every weight.
            bias = torch.zeros(self.num_experts, dtype=torch.float32, device=self.weight.device)
            if self.enable_expert_bias:
                del self.expert_bias
            self.expert_bias = torch.nn.Parameter(bias, requires_grad=False)
        # int64: Float16Module casts floating buffers to bf16, which cannot count past 256 exactly.
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.long,
                                                              device=self.weight.device), persistent=False)
        self.last_topk_indices: Tensor | None = None

    def _apply(self, fn, *args, **kwargs):
        # Float16Module casts the whole model to bf16: the bias keeps its fp32 values (megatron casts it back only
        # at the first forward, rounded), so it is exported, synced and checksummed as the checkpoint holds it.
        kept = None if getattr(self, "expert_bias", None) is None else self.expert_bias.data
        super()._apply(fn, *args, **kwargs)
        if kept is not None:
            self.expert_bias.data = kept.to(self.expert_bias.device)  # a move, if fn was one; never a cast
        return self

    def _choose(self, scores: Tensor, topk: int, num_groups=None, group_topk=None) -> tuple[Tensor, Tensor]:
        # The signature of megatron's compute_topk, so its routing replay can stand in for it.
        return choose_experts(scores, self.rule, self.expert_bias)  # None without score_bias

    def routing(self, logits: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(probs, routing_map), both [tokens, experts]: the weights of the chosen experts, and which they are."""
        logits = logits.view(-1, self.num_experts)
        scores = routing_scores(logits, self.rule)
        if self.router_replay is None:
            chosen, indices = self._choose(scores, self.topk)
        else:
            chosen, indices = self.router_replay.get_replay_topk(scores, self.topk, self.rule.num_groups,
                                                                 self.rule.group_topk, self._choose)
        weights = expert_weights(chosen, self.rule)
        probs = torch.zeros_like(scores).scatter(1, indices, weights)
        routing_map = torch.zeros_like(scores, dtype=torch.int).scatter(1, indices, 1).bool()
        self.last_topk_indices = indices.detach()
        if torch.is_grad_enabled():  # training forwards (and their recompute), not log-prob passes
            with torch.no_grad():
                load = routing_map.sum(dim=0)
                self.tokens_per_expert += load
                if self.enable_expert_bias:  # what megatron's finalize_model_grads updates the bias from
                    self.local_tokens_per_expert += load
        return probs.type_as(logits), routing_map


def expert_bias_update_options(config, rate: float) -> dict:
    """TransformerConfig fields of the aux-loss-free bias update (actor.moe_router_bias_update_rate > 0)."""
    if rate < 0:
        raise ValueError(f"actor.moe_router_bias_update_rate={rate}: expected >= 0 (0 = off)")
    if not config.num_moe_experts or config.moe_router_score_function != "sigmoid":
        raise ValueError(f"actor.moe_router_bias_update_rate={rate} needs a mixture-of-experts model with sigmoid "
                         "routing scores and e_score_correction_bias (DeepSeek-V3); this model has "
                         f"{'no experts' if not config.num_moe_experts else 'softmax scores'}")
    return dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate)


def snapshot_expert_biases(models) -> list[tuple[Tensor, Tensor]]:
    """(bias, a copy of it) of every router whose bias megatron's aux-loss-free update moves: finalize_model_grads
    moves it at the end of the backward pass, before the update is judged finite, so a skipped update puts it
    back (restore_expert_biases). Empty when the update is off."""
    return [(r.expert_bias, r.expert_bias.detach().clone()) for r in _routers(models) if r.enable_expert_bias]


def restore_expert_biases(snapshot: list[tuple[Tensor, Tensor]]) -> None:
    with torch.no_grad():
        for bias, kept in snapshot:
            bias.copy_(kept)


def reset_expert_load(models) -> None:
    for router in _routers(models):
        router.tokens_per_expert.zero_()


def expert_load_metrics(models, config) -> dict[str, float]:
    """Tokens routed to each expert of each DeepSeek MoE layer since reset_expert_load, summed over the job:
    'expert_load/layer_{L}/expert_{E}' (L the global 0-based layer), and 'expert_load/max_over_mean', the most
    loaded expert's count over the mean, the worst layer's. Collective over the job (every rank calls it);
    the same dict on every rank. Resets the counts."""
    if not config.num_moe_experts:
        return {}
    routers = _routers(models)
    local = {}
    if routers:
        counts = torch.stack([r.tokens_per_expert for r in routers])
        # Each data-parallel (and context-parallel) rank routes its own tokens; TP ranks route the same tokens,
        # unless sequence parallelism splits them.
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if config.sequence_parallel:
            dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
        for router, row in zip(routers, counts.tolist()):
            local[router.layer_number - 1] = row
        reset_expert_load(models)
    stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, local, group=parallel_state.get_pipeline_model_parallel_group())
    layers = {layer: row for stage in stages for layer, row in stage.items()}
    if not layers:
        return {}
    metrics = {f"expert_load/layer_{layer}/expert_{e}": float(n)
               for layer, row in sorted(layers.items()) for e, n in enumerate(row)}
    ratios = [max(row) * len(row) / sum(row) for row in layers.values() if sum(row)]
    return metrics | ({"expert_load/max_over_mean": max(ratios)} if ratios else {})


def _routers(models) -> list[DeepSeekRouter]:
    return [m for model in models for m in model.modules() if isinstance(m, DeepSeekRouter)]
