"""Qwen3.5 dense text models (transformers' Qwen3_5ForCausalLM, model_type qwen3_5_text): a hybrid decoder whose
`layer_types` name each layer's token mixer.

- "linear_attention": a gated delta net (gated_delta_net.py): in_proj_qkv / in_proj_z / in_proj_b / in_proj_a
  fused into megatron's in_proj, whose rows on each TP rank are [q; k; v; z; b; a] of its heads; the depthwise
  conv1d over q, k, v; dt_bias and A_log per value head; `norm` over a value head (plain weight, gated by silu(z));
  out_proj.
- "full_attention": grouped-query attention with an output gate (megatron's attention_output_gate): q_proj holds,
  per query head, its query rows then its gate rows; megatron's linear_qkv, per query group, the group's query heads,
  their gates, then the key and the value head. QK-norm, RoPE on the first partial_rotary_factor (0.25) of each
  head (megatron's rotary_percent). transformers' interleaved M-RoPE sections reduce to plain RoPE for text, whose
  three position ids are equal.
Every other RMSNorm (input, post-attention, final, q/k) scales by (1 + weight) (norm.py's zero-centred RMSNorm);
the MLP is SwiGLU.

The engine runs tensor parallelism (with or without sequence parallelism) by heads: the linear-attention norm's
weight, used by every head, gets its gradient summed over TP in the layer itself (gated_delta_net.py says why), and
tests/models/test_qwen3_5.py checks TP=2, TP=2 with SP and PP=2 against transformers, and GRPO at TP=2. TP must
divide linear_num_key_heads (megarl.utils.hf_config.parallel_limit refuses others by key). The weight sync gathers
in_proj_qkv and conv1d, of which each rank holds its heads' rows of q, k and v, in the resharder's TP order and puts
them back in the HF order (megarl.reshard.inventory.TensorSpec.parts); a sharded delivery of them at TP > 1 other
than whole tensors is refused there. The published
(vision-language) checkpoints, Qwen3_5ForConditionalGeneration, train this language model as a text-only policy:
qwen3_5_mm.py. The mixture-of-experts variant is qwen3_next.py's.
rollout.engine=sglang: megarl/rollout/sglang_layout.py holds SGLang's names and TP cuts (in_proj_qkvz / in_proj_ba
fused part by part, conv1d cut per part, the attention without self_attn.) for full delivery at any rollout.sglang_tp
and sharded delivery at rollout.sglang_tp=1; sharded delivery at sglang_tp > 1 is refused (sglang_layout.
check_hybrid_rollout says why). Tested against SGLang's loading rules written out in tests/rollout/
test_weight_layout_qwen3_5.py, not against an SGLang server. SGLang's models/qwen3_5.py registers only the
vision-language Qwen3_5(Moe)ForConditionalGeneration as entry classes (its text model is their language part): a
text-only Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM checkpoint may not start there; the published checkpoints
(qwen3_5_mm.py) do.
"""

from __future__ import annotations

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.decoder import DecoderFamily, head_dim
from megarl.models.gated_delta_net import GatedDeltaNet
from megarl.models.norm import GateNorm
from megarl.models.sharding import WeightMap, replicated, split_dim
from megarl.utils.hf_config import layer_types

LINEAR, FULL = "linear_attention", "full_attention"


def gated_qkv(num_heads: int, num_kv_heads: int, dim: int) -> dict:
    """q_proj (per head: query rows, then gate rows), k_proj, v_proj -> megatron's gated linear_qkv (module
    docstring); TP ranks hold whole query groups."""
    per_group = num_heads // num_kv_heads

    def to_shard(ts, rank, size):
        q_gate, k, v = ts
        rest = q_gate.shape[1:]
        q_gate = q_gate.reshape(num_kv_heads, per_group, 2, dim, *rest)
        fused = torch.cat([q_gate[:, :, 0].reshape(num_kv_heads, per_group * dim, *rest),
                           q_gate[:, :, 1].reshape(num_kv_heads, per_group * dim, *rest),
                           k.reshape(num_kv_heads, dim, *rest), v.reshape(num_kv_heads, dim, *rest)], dim=1)
        return fused.reshape(-1, *rest).chunk(size, 0)[rank]

    def from_shards(shards):
        fused = torch.cat(shards, 0)
        rest = fused.shape[1:]
        q, gate, k, v = fused.reshape(num_kv_heads, 2 * (per_group + 1) * dim, *rest).split(
            [per_group * dim, per_group * dim, dim, dim], dim=1)
        q_gate = torch.stack([q.reshape(num_kv_heads, per_group, dim, *rest),
                              gate.reshape(num_kv_heads, per_group, dim, *rest)], dim=2)
        return [t.reshape(-1, *rest) for t in (q_gate, k, v)]

    return dict(to_shard=to_shard, from_shards=from_shards)


def per_rank_parts(sizes: list[int]) -> dict:
    """HF tensors stacked along dim 0 (sizes: each one's rows) -> a TP shard of each, concatenated: [part_0 of this
    rank; part_1 of this rank; ...] (the layout of megatron's gated-delta-net in_proj and conv1d)."""

    def to_shard(ts, rank, size):
        return torch.cat([t.chunk(size, 0)[rank] for t in ts])

    def from_shards(shards):
        tp = len(shards)
        pieces = [s.split([n // tp for n in sizes], 0) for s in shards]
        return [torch.cat([p[i] for p in pieces]) for i in range(len(sizes))]

    return dict(to_shard=to_shard, from_shards=from_shards)


def split_parts(sizes: list[int]) -> dict:
    """One HF tensor made of parts along dim 0 (conv1d over [q; k; v]) cut per part, as per_rank_parts."""
    parts = per_rank_parts(sizes)
    return dict(to_shard=lambda ts, rank, size: parts["to_shard"](list(ts[0].split(sizes, 0)), rank, size),
                from_shards=lambda shards: [torch.cat(parts["from_shards"](shards))])


class Qwen3_5(DecoderFamily):
    name = "Qwen3.5"
    architectures = ("Qwen3_5ForCausalLM", "qwen3_5_text")
    qk_norm = True
    partial_rotary_factor = 0.25  # transformers' Qwen3_5TextConfig default

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        kinds = set(layer_types(hf))
        if not kinds <= {LINEAR, FULL} or len(layer_types(hf)) != hf["num_hidden_layers"]:
            raise ValueError(f"Qwen3.5 layer_types {layer_types(hf)}: expected {hf['num_hidden_layers']} of "
                             f"{LINEAR!r} / {FULL!r}")

    def attention_config(self, hf: dict) -> dict:
        return dict(attention_output_gate=True, layernorm_zero_centered_gamma=True,
                    experimental_attention_variant="gated_delta_net",
                    linear_attention_freq=[int(kind == LINEAR) for kind in layer_types(hf)],
                    linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
                    linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
                    linear_num_key_heads=hf["linear_num_key_heads"],
                    linear_num_value_heads=hf["linear_num_value_heads"])

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        spec = super().layer_spec(hf, layer)  # a new spec on every call: changed in place
        if layer_types(hf)[layer] == LINEAR:
            spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=GateNorm, out_proj=RowParallelLinear))
        return spec

    def attention_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        m = f"decoder.layers.{layer}.self_attention."
        if layer_types(hf)[layer] == FULL:
            h = f"model.layers.{layer}.self_attn."
            qkv = gated_qkv(hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf))
            return [WeightMap(m + "linear_qkv.weight", tuple(h + f"{p}_proj.weight" for p in "qkv"), **qkv),
                    WeightMap(m + "linear_proj.weight", (h + "o_proj.weight",), **split_dim(1)),
                    WeightMap(m + "q_layernorm.weight", (h + "q_norm.weight",), **replicated()),
                    WeightMap(m + "k_layernorm.weight", (h + "k_norm.weight",), **replicated())]
        h = f"model.layers.{layer}.linear_attn."
        qk = hf["linear_key_head_dim"] * hf["linear_num_key_heads"]
        v, heads = hf["linear_value_head_dim"] * hf["linear_num_value_heads"], hf["linear_num_value_heads"]
        return [self.linear_in_proj(hf, layer, qk, v, heads),
                WeightMap(m + "conv1d.weight", (h + "conv1d.weight",), **split_parts([qk, qk, v])),
                WeightMap(m + "dt_bias", (h + "dt_bias",), **split_dim(0)),
                WeightMap(m + "A_log", (h + "A_log",), **split_dim(0)),
                WeightMap(m + "out_norm.weight", (h + "norm.weight",), **replicated()),
                WeightMap(m + "out_proj.weight", (h + "out_proj.weight",), **split_dim(1))]

    def linear_in_proj(self, hf: dict, layer: int, qk: int, v: int, heads: int) -> WeightMap:
        """megatron's in_proj of linear-attention layer `layer` from its checkpoint projections (qk: query / key
        rows, v: value rows, heads: value heads)."""
        h = f"model.layers.{layer}.linear_attn."
        return WeightMap(f"decoder.layers.{layer}.self_attention.in_proj.weight",
                         tuple(h + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), **in_proj(qk, v, heads))


def in_proj(qk: int, v: int, heads: int) -> dict:
    """in_proj_qkv ([q; k; v]), in_proj_z, in_proj_b, in_proj_a -> megatron's in_proj: per TP rank its q, k, v, z, b,
    a rows."""
    parts = per_rank_parts([qk, qk, v, v, heads, heads])

    def to_shard(ts, rank, size):
        qkv, z, b, a = ts
        return parts["to_shard"]([*qkv.split([qk, qk, v], 0), z, b, a], rank, size)

    def from_shards(shards):
        q, k, v_, z, b, a = parts["from_shards"](shards)
        return [torch.cat([q, k, v_]), z, b, a]

    return dict(to_shard=to_shard, from_shards=from_shards)


FAMILY = Qwen3_5()
