"""Rollout routing replay (actor.router_replay=rollout): megatron's routers route each token to the experts the
rollout engine routed it to, so the old log-probs and the policy gradient are those of the network that sampled
the tokens.

The rollout's record is `routed_experts` [B, T, layers, topk] (megarl.protocol): GLOBAL expert ids of every
decoder layer (a dense layer's entries are never read), -1 where the rollout recorded nothing (the last token,
which no forward saw; padding; a prompt whose prefill routing the engine did not return). With expert
parallelism the router picks before tokens are dispatched, so every EP rank needs the full top-k of its own
tokens: nothing is sliced by EP.

megatron-core's RouterReplay (TransformerConfig.moe_enable_routing_replay) gives each router an instance that
get_replay_topk consults. Its REPLAY_FORWARD takes every token's experts from the target; RolloutRouterReplay keeps
that and lets tokens without a record (-1) route by the router's own choice. The instances are this engine's
routers' own (megatron's global list holds those of every model built in the process).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor


class RolloutRouterReplay(RouterReplay):
    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
        target = self.target_topk_idx.to(scores.device, torch.long)
        if target.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} recorded experts for this layer's "
                             f"{tuple(own.shape)} tokens x top-k")
        indices = torch.where((target >= 0).all(-1, keepdim=True), target, own)
        return scores.gather(1, indices), indices


def install(models) -> list[tuple[int, RolloutRouterReplay]]:
    """A RolloutRouterReplay on every router of `models` (one or more chunks): [(global 0-based layer, replay)].
    Refuses a model without routers (a dense model) and megatron's fused router, which skips the replay hook."""
    routers = [m for model in models for m in model.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError("actor.router_replay=rollout needs a mixture-of-experts policy; this model has no routers")
    if routers[0].config.moe_router_fusion:
        raise ValueError("actor.router_replay=rollout: megatron's fused router (moe_router_fusion) does not replay")
    installed = []
    for router in routers:
        replay = RolloutRouterReplay()
        RouterReplay.global_router_replay_instances.remove(replay)  # ours, found through `installed`
        router.router_replay = replay
        installed.append((router.layer_number - 1, replay))
    return installed


def set_targets(installed: list[tuple[int, RolloutRouterReplay]], routed: Tensor | None) -> None:
    """Replay `routed` [tokens, layers, topk] (the tokens in the routers' order) in the next forward; None: every
    router chooses itself."""
    for layer, replay in installed:
        replay.clear_indices()
        if routed is None:
            replay.clear_router_replay_action()
        else:
            replay.set_target_indices(routed[:, layer])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def router_order(packed: Tensor, sequence_parallel: bool, tp_size: int, tp_rank: int) -> Tensor:
    """A micro-batch's packed record [rows, W, layers, topk] (already this CP rank's positions) -> [tokens, layers,
    topk] in the order megatron's routers see the tokens: sequence-major ([W, rows] flattened), and under sequence
    parallelism this TP rank's slice of the positions."""
    seq_major = packed.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        seq_major = seq_major.chunk(tp_size, dim=0)[tp_rank]
    return seq_major.reshape(-1, *packed.shape[2:])
