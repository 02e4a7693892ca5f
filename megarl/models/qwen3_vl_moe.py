"""Qwen3-VL-MoE (transformers' Qwen3VLMoeForConditionalGeneration, model_type qwen3_vl_moe): Qwen3-VL (qwen3_vl.py:
its tower, DeepStack, interleaved M-RoPE, checkpoint names) with Qwen3-MoE's language model (qwen3_moe.py, moe.py:
softmax top-k routing over megatron's MoELayer, EP), every layer a mixture of experts. Its router always renormalises
its top-k weights (transformers' Qwen3VLMoeTextTopKRouter; config.json has no norm_topk_prob). Each layer's experts
are stacked in the checkpoint (experts.gate_up_proj, experts.down_proj), read as one row per megatron expert
(WeightMap.stacked) and written back stacked, in the published layout (stacked_gate_up, stacked_down).
RL runs sync them as gpt-oss's (reshard.inventory.STACKED_EXPERTS): the planner and the resharder list each expert
as its row of them, a full delivery carries each stacked tensor whole (input-major) under its checkpoint name, which
the hf rollout engine addresses (rollout/hf.py checkpoint_views) and SGLang loads, transposed into its FusedMoE
w13/w2. Sharded delivery is refused by key (config.model_layout.check_rollout_model), and into SGLang so is checksum
verification (that FusedMoE layout is not modelled: the deep check verifies); SGLang serving is untested on GPU.
"""

from __future__ import annotations

import torch

from megarl.models.qwen3_moe import Qwen3Moe
from megarl.models.qwen3_vl import Qwen3VL
from megarl.models.sharding import WeightMap, fused_gate_up, replicated
from megarl.utils.hf_config import expert_width


def stacked_gate_up(width: int) -> dict:
    """An expert's row of the stacked experts.gate_up_proj -> megatron's fc1 [gate rows; up rows]. The published
    checkpoints store it input-major [hidden, 2 x width] (gate columns, then up columns), as SGLang loads it;
    transformers 5 saves it output-major [2 x width, hidden], which is read too (by its shape: where hidden ==
    2 x width the published layout is assumed) and written back input-major."""
    halves = fused_gate_up()

    def to_shard(ts, rank, size):
        t = ts[0] if ts[0].shape[0] == 2 * width != ts[0].shape[1] else ts[0].t()
        return halves["to_shard"]([t[:width], t[width:]], rank, size)

    def from_shards(shards):
        return [torch.cat(halves["from_shards"](shards)).t().contiguous()]

    return dict(to_shard=to_shard, from_shards=from_shards)


def stacked_down(width: int) -> dict:
    """An expert's row of the stacked experts.down_proj, input-major [width, hidden] as published (transformers 5's
    output-major [hidden, width] read too) -> megatron's row-parallel fc2 [hidden, width]."""
    def to_shard(ts, rank, size):
        t = ts[0] if ts[0].shape[1] == width != ts[0].shape[0] else ts[0].t()
        return t.chunk(size, 1)[rank]

    return dict(to_shard=to_shard, from_shards=lambda shards: [torch.cat(shards, 1).t().contiguous()])


class Qwen3VLMoe(Qwen3VL, Qwen3Moe):
    """Qwen3VL's model and names, Qwen3Moe's experts and refusals (module docstring)."""

    name = "Qwen3-VL-MoE"
    architectures = ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe")

    def renormalises(self, hf: dict) -> bool:
        return True

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        experts, width = self.num_experts(hf), expert_width(hf)[0]
        maps = [WeightMap(m + "router.weight", (h + "gate.weight",), **replicated())]
        for e in range(experts):
            x = m + f"experts.local_experts.{e}."
            maps += [WeightMap(x + "linear_fc1.weight", (h + "experts.gate_up_proj",), stacked=(e, experts),
                               **stacked_gate_up(width)),
                     WeightMap(x + "linear_fc2.weight", (h + "experts.down_proj",), stacked=(e, experts),
                               **stacked_down(width))]
        return maps


FAMILY = Qwen3VLMoe()
