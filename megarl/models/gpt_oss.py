"""gpt-oss (transformers' GptOssForCausalLM, model_type gpt_oss: gpt-oss-20b, gpt-oss-120b): grouped-query attention
with q/k/v/o biases and a learnable sink per head, sliding-window and full layers by `layer_types`, YaRN RoPE, and
a mixture of experts with biases in every layer.

As transformers 5.12 computes it, and how megatron-core computes the same:
- Attention sinks: each head's softmax runs over its scores and one more logit, self_attn.sinks[head], whose
  probability is dropped (the weights sum to less than 1). megatron's DotProductAttention with
  softmax_type='learnable' does exactly this with its softmax_offset parameter (one per head, split over TP by
  head; SinkAttention marks it so).
- Sliding windows: a query at position q attends to keys k with q - sliding_window < k <= q in the
  "sliding_attention" layers, to every earlier key in the "full_attention" ones. megatron's own window
  (TransformerConfig.window_size) replaces the attention mask with the window, losing the block-diagonal mask of
  packed rows; Gemma 3's WindowedAttention adds the window to the mask it is given instead (layer_spec picks it by
  the layer's layer_types entry). megarl's SDPAttention ('sdpa', 'varlen') computes neither sinks nor windows: the
  family runs actor.attention=local only (local_attention_only: 'auto' is local, sdpa/varlen and context
  parallelism are refused by name). On the GPU that is megatron's unfused attention: correct, not fast.
- YaRN RoPE (rope_type 'yarn', rotate-half over whole heads): megatron's YarnRotaryEmbedding (GPTModel's
  position_embedding_type='yarn') computes transformers' frequencies (inv_freq interpolated by factor between
  the correction range of beta_fast / beta_slow over original_max_position_embeddings; truncate=false, as the
  published models say, is megatron's correction_range_round_to_int=False) and scales cos and sin by the same
  attention factor 0.1 ln(factor) + 1 (mscale / mscale_all_dim: their ratio when both are set, as transformers).
  GPTModel reads those settings as yarn_* attributes of its config: YarnTransformerConfig adds them.
  An explicit attention_factor and partial_rotary_factor != 1 are refused by key.
- Router: logits = linear(x, router.weight, router.bias); the top-k logits, then a softmax over those k.
  megatron's TopKRouter with a bias (add_bias_linear) and moe_router_pre_softmax=False (moe.py's renormalised
  case). No load-balancing loss (moe.py).
- Experts: gate_up = x W_gu + b_gu with gate and up INTERLEAVED along the output (gate = [..., 0::2], up =
  [..., 1::2]); gate clamped above at 7, up to [-7, 7]; out = ((up + 1) * gate * sigmoid(1.702 gate)) W_d + b_d,
  times the routing weight (the bias too). megatron's expert MLP with quick_gelu (x * sigmoid(1.702 x)),
  glu_linear_offset=1 and activation_func_clamp_value=7 computes that on [gate rows; up rows] (its fc1 halves), and
  scales the fc2 bias by the routing weight too. megatron-core takes expert biases only at expert-TP size 1:
  actor.parallel.etp=1 (refused otherwise); experts are split over EP and whole on every TP rank, each of which
  routes its own tokens under sequence parallelism: GptOssExperts and ExpertOutputLinear keep their gradients whole
  (and training possible at all) where megatron's defaults assume expert-TP = TP.
- The checkpoint keeps each layer's experts stacked (transformers' GptOssExperts, no conversion on save):
  mlp.experts.gate_up_proj [E, hidden, 2 x intermediate] (input-major), gate_up_proj_bias [E, 2 x intermediate],
  down_proj [E, intermediate, hidden], down_proj_bias [E, hidden]. Each expert's weight maps carry `stacked`
  (sharding.WeightMap): import reads its row, export stacks the rows back.
- MXFP4 checkpoints (the published ones: quant_method 'mxfp4', the experts' weights as *_blocks / *_scales):
  read dequantized (hf_checkpoint.MXFP4), exported unquantized in the model's dtype.
- swiglu_limit (the published config.json's 7.0, which SGLang reads): transformers ignores it and clamps at 7; any
  other value is refused by key. transformers' config writer drops it; megarl's export writes it
  (hf_checkpoint.export_config).
Rollouts: the planner's inventory and the resharder list each expert as its row of the stacked tensors; the weight
sync (full delivery only: config.model_layout.check_rollout_model) carries each stacked tensor whole under its
checkpoint name, which the transformers rollout engine holds as is and SGLang's GptOssForCausalLM loads (the stacked
bf16 gate_up_proj / down_proj and their biases, transposed into FusedMoE's w13 / w2). Not modelled: that FusedMoE
layout, so a sync into SGLang is verified by the deep check only (trainer.verify_weight_sync_deep); SGLang serving
of gpt-oss from megarl is untested on GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.activations import quick_gelu
from megatron.core.tensor_parallel.layers import RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.decoder import rope_parameters
from megarl.models.gemma3 import WindowedAttention
from megarl.models.hf_checkpoint import SWIGLU_LIMIT
from megarl.models.moe import SoftmaxTopKMoe
from megarl.models.sharding import WeightMap, fused_gate_up, replicated, split_dim

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """TransformerConfig with the yarn_* settings GPTModel's YaRN embedding and megatron's attention read by getattr
    (MLATransformerConfig has them; a plain TransformerConfig does not)."""
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_correction_range_round_to_int: bool = True


class SinkAttention(DotProductAttention):
    """megatron's DotProductAttention, its learnable sinks (softmax_type='learnable') marked split over TP by head:
    megatron leaves softmax_offset unmarked, and its grad norm counts an unmarked parameter on TP rank 0 only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        set_tensor_model_parallel_attributes(self.softmax_offset, is_parallel=True, dim=0, stride=1)


class WindowedSinkAttention(SinkAttention, WindowedAttention):
    """SinkAttention within Gemma 3's sliding window (the window added to the mask it is given)."""


class ExpertOutputLinear(RowParallelLinear):
    """An expert's linear_fc2. Its output is a tensor of its own: where neither expert-TP nor EP splits the experts,
    megatron's RowParallelLinear returns its TP reduction's input as is (a custom Function's view), and its MLP then
    adds the bias weighted by the routing into that output in place, which autograd refuses in training. Its bias is
    not marked sequence-parallel: its gradient is a sum over this rank's tokens, which GptOssExperts' expert-data-
    parallel reduction completes (megatron marks it, and would sum it over TP a second time)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.sequence_parallel = False

    def forward(self, input_):
        output, bias = super().forward(input_)
        return (output if self.explicit_expert_comm else output.clone()), bias


class GptOssExperts(SequentialMLP):
    """megatron's SequentialMLP, its parameters always in DDP's expert buffers (allreduce=False). At expert-TP 1
    under TP > 1 with sequence parallelism each TP rank routes only its own slice of the tokens, so every rank's
    expert gradients are partial; megatron sums them over the expert-data-parallel group, which spans those ranks,
    only for parameters so marked, and marks them only at EP > 1."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.parameters():
            param.allreduce = False


def layer_kinds(hf: dict) -> list[str]:
    """Each layer's attention: config.json's layer_types, else transformers' default (sliding, full, sliding, ...)."""
    return hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(hf["num_hidden_layers"])]


def yarn_fields(hf: dict) -> dict:
    """YarnTransformerConfig's yarn_* fields for config.json's rope_parameters (module docstring: YaRN RoPE)."""
    params = rope_parameters(hf)
    if params["rope_type"] != "yarn":
        raise ValueError(f"gpt-oss with rope_type={params['rope_type']!r} is not supported (yarn only)")
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"gpt-oss: rope_parameters.{key} is required for YaRN RoPE")
    if params.get("attention_factor") is not None:
        raise ValueError("gpt-oss with rope_parameters.attention_factor is not supported (megatron derives it)")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("gpt-oss with partial_rotary_factor != 1 is not supported (YaRN over whole heads)")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)  # transformers uses their ratio only when both are set and non-zero
    return dict(yarn_rotary_scaling_factor=float(params["factor"]),
                yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                yarn_mscale=float(mscale) if both else None, yarn_mscale_all_dim=float(mscale_all_dim) if both else None,
                yarn_correction_range_round_to_int=bool(params.get("truncate", True)))


def interleaved_gate_up(input_major: bool) -> dict:
    """An expert's gate/up rows interleaved in HF (gate at even, up at odd positions of the output dimension;
    `input_major`: the weight is stored [hidden, 2 x intermediate]) -> megatron's fc1 [gate rows; up rows]."""
    halves = fused_gate_up()

    def to_shard(ts, rank, size):
        t = ts[0].t() if input_major else ts[0]
        return halves["to_shard"]([t[0::2], t[1::2]], rank, size)

    def from_shards(shards):
        gate, up = halves["from_shards"](shards)
        out = torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])  # rows gate0, up0, gate1, up1, ...
        return [out.t().contiguous() if input_major else out]

    return dict(to_shard=to_shard, from_shards=from_shards)


def transposed() -> dict:
    """HF's input-major down_proj [intermediate, hidden] -> megatron's row-parallel fc2 [hidden, intermediate]."""
    return dict(to_shard=lambda ts, rank, size: ts[0].t().chunk(size, 1)[rank],
                from_shards=lambda shards: [torch.cat(shards, 1).t().contiguous()])


class GptOss(SoftmaxTopKMoe):
    name = "gpt-oss"
    architectures = ("GptOssForCausalLM", "gpt_oss")
    qkv_bias = True
    local_attention_only = True  # sinks and windows (module docstring)

    def renormalises(self, hf: dict) -> bool:
        return True

    def check_supported(self, hf: dict) -> None:
        if not hf.get("attention_bias", True):
            raise ValueError("gpt-oss with attention_bias=false is not supported (q/k/v/o biases)")
        kinds = layer_kinds(hf)
        if len(kinds) != hf["num_hidden_layers"] or not set(kinds) <= {SLIDING, FULL}:
            raise ValueError(f"gpt-oss layer_types {kinds}: expected {hf['num_hidden_layers']} of {SLIDING!r} / "
                             f"{FULL!r}")
        if hf.get("swiglu_limit", SWIGLU_LIMIT) != SWIGLU_LIMIT:
            raise ValueError(f"gpt-oss with swiglu_limit={hf['swiglu_limit']} is not supported (transformers clamps "
                             f"at {SWIGLU_LIMIT} whatever it says)")
        if SLIDING in kinds and not hf.get("sliding_window"):
            raise ValueError("gpt-oss with sliding_attention layers needs sliding_window (a positive window)")
        yarn_fields(hf)

    def transformer_config(self, hf: dict, tp: int, pp: int, params_dtype: torch.dtype, use_cpu_initialization: bool,
                           ep: int = 1, etp: int | None = None, **layout) -> YarnTransformerConfig:
        if (etp or tp) != 1:
            raise ValueError(f"gpt-oss needs expert-tensor-parallel size 1 (megatron-core takes expert biases only "
                             f"there), not {etp or tp}: set actor.parallel.etp=1 (experts split over EP instead)")
        base = super().transformer_config(hf, tp, pp, params_dtype, use_cpu_initialization, ep=ep, etp=etp, **layout)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
        fields |= dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                       activation_func_clamp_value=SWIGLU_LIMIT, softmax_type="learnable")
        return YarnTransformerConfig(**fields, **yarn_fields(hf))

    def rope_kwargs(self, hf: dict) -> dict:
        return dict(rotary_base=float(rope_parameters(hf)["rope_theta"]))

    def gpt_model_kwargs(self, hf: dict, tp: int) -> dict:
        return super().gpt_model_kwargs(hf, tp) | dict(position_embedding_type="yarn")

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        spec = super().layer_spec(hf, layer)
        experts = spec.submodules.mlp.submodules.experts
        experts.module, experts.submodules.linear_fc2 = GptOssExperts, ExpertOutputLinear
        attention = spec.submodules.self_attention.submodules
        if layer_kinds(hf)[layer] == SLIDING:
            attention.core_attention = ModuleSpec(module=WindowedSinkAttention, params={"window": hf["sliding_window"]})
        else:
            attention.core_attention = SinkAttention
        return spec

    def attention_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        attn, h = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
        return super().attention_maps(hf, tp, layer) + [
            WeightMap(attn + "linear_proj.bias", (h + "o_proj.bias",), **replicated()),
            WeightMap(attn + "core_attention.softmax_offset", (h + "sinks",), **split_dim(0))]

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        """The router and every expert by GLOBAL expert index, each expert a row of the stacked HF tensors."""
        m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        maps = [WeightMap(m + "router.weight", (h + "router.weight",), **replicated()),
                WeightMap(m + "router.bias", (h + "router.bias",), **replicated())]
        experts = self.num_experts(hf)
        for e in range(experts):
            x, stacked = m + f"experts.local_experts.{e}.", (e, experts)
            maps += [
                WeightMap(x + "linear_fc1.weight", (h + "experts.gate_up_proj",), stacked=stacked,
                          **interleaved_gate_up(input_major=True)),
                WeightMap(x + "linear_fc1.bias", (h + "experts.gate_up_proj_bias",), stacked=stacked,
                          **interleaved_gate_up(input_major=False)),
                WeightMap(x + "linear_fc2.weight", (h + "experts.down_proj",), stacked=stacked, **transposed()),
                WeightMap(x + "linear_fc2.bias", (h + "experts.down_proj_bias",), stacked=stacked, **replicated())]
        return maps


FAMILY = GptOss()
