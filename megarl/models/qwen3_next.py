"""Qwen3-Next (transformers' Qwen3NextForCausalLM, model_type qwen3_next: Qwen3-Next-80B-A3B) and Qwen3.5-MoE text
models (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text: the Qwen3.5 MoE models' language part): Qwen3.5's hybrid
decoder (qwen3_5.py: gated delta nets in the "linear_attention" layers, gated full attention with QK-norm and partial
RoPE in the others, zero-centred RMSNorms) with a sparse mixture of experts in every layer. transformers builds
Qwen3.5-MoE's layers from Qwen3-Next's, so one family serves both; they differ in two things:

- the linear-attention input projections: Qwen3.5-MoE's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (as
  Qwen3.5's); Qwen3-Next's in_proj_qkvz, per key head its q, k rows then the v and z rows of the value heads it
  serves, and in_proj_ba, per key head the b then the a rows of those value heads (transformers'
  fix_query_key_value_ordering). Both go into megatron's in_proj as [q; k; v; z; b; a]; conv1d, over [q; k; v], is
  the same in both.
- the router: softmax over all experts (fp32), top-k, renormalised where norm_topk_prob is set (Qwen3-Next) and
  always (Qwen3.5-MoE, whose config has no such key): moe.py's two cases.
The MoE block: num_experts routed experts of moe_intermediate_size (mlp.experts.{e}.gate_proj/up_proj/down_proj in
the checkpoint; transformers holds them fused in memory, [E, 2I, H], and writes these names), and one shared expert
of shared_expert_intermediate_size (mlp.shared_expert.*) whose output is multiplied by
sigmoid(mlp.shared_expert_gate(x)) before it joins the routed output: megatron's SharedExpertMLP with
moe_shared_expert_gate (its gate_weight [1, H]).

Parallelism: TP as Qwen3.5's (qwen3_5.py: the engine's, checked for Qwen3-Next at TP=2 with SP in tests/models/
test_qwen3_5.py; the sync gathers its conv1d as Qwen3.5's), EP and PP (tests/models/test_qwen3_next.py), and
routing replay (tests/models/test_router_replay.py). Qwen3-Next with dense layers
(decoder_sparse_step != 1, mlp_only_layers) is refused. The published checkpoints' multi-token-prediction tensors
(mtp.*) are neither built nor written back by export (unlike DeepSeek-V3's MTP layer, hf_checkpoint.py), and the
published (vision-language) Qwen3.5-MoE checkpoints, Qwen3_5MoeForConditionalGeneration, train this language model as
a text-only policy: qwen3_5_mm.py. rollout.engine=sglang: megarl/rollout/sglang_layout.py holds both models' SGLang names and TP cuts (the
attention without self_attn., Qwen3.5-MoE's in_proj_qkvz / in_proj_ba fused part by part, Qwen3-Next's cut in
contiguous blocks, conv1d per part, the shared expert in shared_expert.gate_up_proj, routed experts in w13/w2 placed
by --ep-size as Qwen3-MoE's) for full delivery at any rollout.sglang_tp and sharded delivery at sglang_tp=1; refused
(sglang_layout.check_hybrid_rollout): sharded delivery at sglang_tp > 1, and a run without
--disable-shared-experts-fusion in rollout.sglang_args (SGLang may fold the gated shared expert into the routed
experts, which the layout does not model). Tested against SGLang's loading rules written out in tests/rollout/
test_weight_layout_qwen3_5.py, not against an SGLang server. SGLang's models/qwen3_5.py registers only the
vision-language Qwen3_5(Moe)ForConditionalGeneration as entry classes (its text model is their language part): a
text-only Qwen3_5MoeForCausalLM checkpoint may not start there; the published checkpoints (qwen3_5_mm.py) do, and
Qwen3NextForCausalLM is an entry class.
"""

from __future__ import annotations

import torch

from megarl.models.moe import SoftmaxTopKMoe
from megarl.models.qwen3_5 import Qwen3_5, in_proj
from megarl.models.sharding import WeightMap, gated_mlp, replicated

NEXT = "qwen3_next"


class Qwen3Next(Qwen3_5, SoftmaxTopKMoe):
    name = "Qwen3-Next / Qwen3.5-MoE"
    architectures = ("Qwen3NextForCausalLM", NEXT, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ValueError(f"{self.name} with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                             "supported: every layer must be a mixture of experts")

    def transformer_config(self, hf: dict, *args, **kwargs):
        # no dense MLP: Qwen3.5-MoE's config has no intermediate_size (megatron needs a value; Qwen3-Next's is unused)
        return super().transformer_config({"intermediate_size": hf["moe_intermediate_size"], **hf}, *args, **kwargs)

    def renormalises(self, hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", True)) if hf.get("model_type") == NEXT else True

    def moe_config(self, hf: dict, ep: int) -> dict:
        return dict(super().moe_config(hf, ep), moe_shared_expert_gate=True,
                    moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"])

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        m, h = f"decoder.layers.{layer}.mlp.shared_experts.", f"model.layers.{layer}.mlp."
        return [*super().mlp_maps(hf, tp, layer), *gated_mlp(m, h + "shared_expert."),
                WeightMap(m + "gate_weight", (h + "shared_expert_gate.weight",), **replicated())]

    def linear_in_proj(self, hf: dict, layer: int, qk: int, v: int, heads: int) -> WeightMap:
        if hf.get("model_type") != NEXT:
            return super().linear_in_proj(hf, layer, qk, v, heads)
        h = f"model.layers.{layer}.linear_attn."
        return WeightMap(f"decoder.layers.{layer}.self_attention.in_proj.weight",
                         (h + "in_proj_qkvz.weight", h + "in_proj_ba.weight"),
                         **_grouped_in_proj(hf["linear_num_key_heads"], qk, v, heads))


def _grouped_in_proj(key_heads: int, qk: int, v: int, heads: int) -> dict:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba (grouped per key head, module docstring) -> megatron's in_proj,
    through Qwen3.5's in_proj_qkv / z / b / a order."""
    flat = in_proj(qk, v, heads)
    dk, group_v, group_heads = qk // key_heads, v // key_heads, heads // key_heads

    def ungroup(qkvz, ba):
        rest = qkvz.shape[1:]
        q, k, v_, z = qkvz.reshape(key_heads, -1, *rest).split([dk, dk, group_v, group_v], 1)
        b, a = ba.reshape(key_heads, -1, *rest).split([group_heads, group_heads], 1)
        q, k, v_, z, b, a = (t.reshape(-1, *rest) for t in (q, k, v_, z, b, a))
        return [torch.cat([q, k, v_]), z, b, a]

    def group(qkv, z, b, a):
        rest = qkv.shape[1:]
        q, k, v_ = (t.reshape(key_heads, -1, *rest) for t in qkv.split([qk, qk, v], 0))
        z, b, a = (t.reshape(key_heads, -1, *rest) for t in (z, b, a))
        return [torch.cat([q, k, v_, z], 1).reshape(-1, *rest), torch.cat([b, a], 1).reshape(-1, *rest)]

    return dict(to_shard=lambda ts, rank, size: flat["to_shard"](ungroup(*ts), rank, size),
                from_shards=lambda shards: group(*flat["from_shards"](shards)))


FAMILY = Qwen3Next()
