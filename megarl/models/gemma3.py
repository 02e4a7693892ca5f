"""Gemma 3 language models (transformers' Gemma3ForCausalLM, model_type gemma3_text: Gemma-3 1B, and the text fields
of the 4B/12B/27B checkpoints), as transformers 5.12's modeling_gemma3.py computes them:

- every RMSNorm scales by (1 + weight) in float32 (norm.py's zero-centred RMSNorm under layernorm_zero_centered_gamma):
  input_layernorm and pre_feedforward_layernorm (megatron's input_layernorm and pre_mlp_layernorm), q_norm / k_norm
  (QK-norm per head, before RoPE), the final norm, and two norms megatron's layer lacks: post_attention_layernorm on the
  attention's output and post_feedforward_layernorm on the MLP's, before each residual add. Those two live in the
  attention and MLP modules here (Gemma3SelfAttention / Gemma3MLP `.post_layernorm`), so megatron's TransformerLayer
  runs unchanged; under sequence parallelism they see the sequence slice and are marked so (norm.HiddenNorm);
- the token embedding times sqrt(hidden_size), rounded to the embedding's dtype first as transformers does
  (bfloat16 makes sqrt(1152) 34.0, not 33.94); the LM head tied to the embedding (tie_word_embeddings, true unless
  config.json says otherwise: the published 1B config.json omits it);
- a gated MLP with gelu (tanh approximation; hidden_activation gelu_pytorch_tanh), attention scaled by
  query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
- layer_types (or, in older config.json files, sliding_window_pattern: every pattern-th layer global, the others
  local): "sliding_attention" layers attend to the last sliding_window tokens, the current one included
  (key j of query i when i - j < sliding_window), with RoPE of base rope_local_base_freq (transformers 5:
  rope_parameters.sliding_attention.rope_theta); "full_attention" layers attend causally to everything with RoPE of
  base rope_theta (rope_parameters.full_attention), linearly scaled where its rope_type is "linear" (positions / factor:
  megatron's seq_len_interpolation_factor; 8 on 4B/12B/27B).

Per-layer RoPE: GPTModel computes one rotary table and hands it to every layer. Gemma3Model's table (LayerTypeRotary)
is the global layers' and the local layers' tables side by side in the last dimension, [positions, 1, 1, 2 x head_dim];
each attention takes its half. It is an argument of each layer like megatron's own table (activation recompute and
pipeline stages see it as they see that), and megarl's position-id indexing (packing.reset_rotary_positions) indexes
both halves alike.

Sliding windows run in WindowedAttention, megatron's DotProductAttention with the window added to the mask it is
given (the block-causal mask of packed rows: the window counts tokens within the row, which within a packed sequence
is the distance within that sequence). megatron's own window_size would replace that mask with one window over the
whole row. megarl's SDPAttention (actor.attention=sdpa/varlen) has no window: Gemma 3 runs actor.attention=local
(auto picks it; sdpa and varlen are refused by name, and with them context parallelism), i.e. unfused attention that
materialises [heads, tokens, tokens] scores per layer on the GPU as on the CPU: long rows on large models need
activation recompute or smaller micro-batches.

Refused by key: attn_logit_softcapping and final_logit_softcapping other than null (Gemma 2's soft-capping; every
Gemma 3 sets null), use_bidirectional_attention (EmbeddingGemma), attention_bias, any other activation, and RoPE
scaling other than linear. The multimodal checkpoints (Gemma3ForConditionalGeneration, model_type gemma3: 4B to 27B)
train this language model as a text-only policy: gemma3_mm.py.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import sharded_state_dict_default

from megarl.models.decoder import DecoderFamily
from megarl.models.norm import HiddenNorm
from megarl.models.sharding import WeightMap, replicated

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig's defaults for keys a config.json may leave out
DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh"}
THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def with_defaults(hf: dict) -> dict:
    return {**DEFAULTS, **hf}


def gemma3_layer_types(hf: dict) -> list[str]:
    hf = with_defaults(hf)
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = hf["sliding_window_pattern"]
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(hf["num_hidden_layers"])]


def gemma3_rope(hf: dict) -> dict[str, dict]:
    """Each layer type's RoPE parameters (rope_type, rope_theta, factor) from either config.json spelling:
    transformers 5's rope_parameters per layer type, or rope_theta / rope_local_base_freq / rope_scaling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        by_type = {kind: dict(params.get(kind) or {}) for kind in (FULL, SLIDING)}
    else:
        by_type = {FULL: dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta")),
                   SLIDING: {"rope_theta": hf.get("rope_local_base_freq")}}
    for kind, p in by_type.items():
        p["rope_type"] = p.get("rope_type", p.get("type", "default"))
        if p.get("rope_theta") is None:
            p["rope_theta"] = THETA[kind]
    return by_type


def _linear_factor(params: dict, kind: str) -> float | None:
    if params["rope_type"] == "default":
        return None
    if params["rope_type"] != "linear":
        raise ValueError(f"Gemma 3 with {kind} RoPE scaling {params['rope_type']!r} is not supported (default or "
                         "linear)")
    return float(params["factor"])


class LayerTypeRotary(torch.nn.Module):
    """GPTModel's rotary_pos_emb for two layer types: [global table, local table] along the last dimension."""

    def __init__(self, full: RotaryEmbedding, sliding: RotaryEmbedding):
        super().__init__()
        self.full, self.sliding = full, sliding

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.full.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        return torch.cat([self.full(max_seq_len, offset, packed_seq, cp_group),
                          self.sliding(max_seq_len, offset, packed_seq, cp_group)], dim=-1)


class Gemma3Model(GPTModel):
    """GPTModel with Gemma's scaled embedding and a global and a local RoPE table (module docstring)."""

    def __init__(self, config, transformer_layer_spec, *, local_rotary_base: float, **kwargs):
        super().__init__(config, transformer_layer_spec, **kwargs)
        self.rotary_pos_emb = LayerTypeRotary(self.rotary_pos_emb, RotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=local_rotary_base,
            use_cpu_initialization=config.use_cpu_initialization))
        if self.pre_process:
            scale = math.sqrt(config.hidden_size)
            # in the embedding's dtype, as transformers multiplies (its bf16 rounding of the scale included)
            self.embedding.register_forward_hook(lambda module, args, out: out * torch.tensor(scale, dtype=out.dtype))


class Gemma3SelfAttention(SelfAttention):
    """megatron's self-attention on its layer type's half of the RoPE table, with post_attention_layernorm on its
    output."""

    def __init__(self, config, submodules, layer_number, *, sliding: bool, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.sliding = sliding
        self.post_layernorm = HiddenNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is None:
            raise ValueError("Gemma 3 attention needs the model's rotary table (Gemma3Model)")
        half = rotary_pos_emb.shape[-1] // 2
        rotary_pos_emb = (rotary_pos_emb[..., half:] if self.sliding else rotary_pos_emb[..., :half]).contiguous()
        out, bias = super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return self.post_layernorm(out), bias


class Gemma3MLP(MLP):
    """megatron's MLP with post_feedforward_layernorm on its output. The layer spec names the class itself, with the
    local spec's linears as its default submodules: megatron's TransformerLayer warns, per layer, of an MLP spec whose
    module is not MLP itself."""

    def __init__(self, config, submodules: MLPSubmodules | None = None, **kwargs):
        submodules = submodules or MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        super().__init__(config, submodules, **kwargs)
        self.post_layernorm = HiddenNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states, *args, **kwargs):
        out, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(out), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """MLP's asks each child for its sharded_state_dict, which the post norm (a torch module) lacks: the norm goes
        through megatron's default for other modules (replicated), as the layer's own norms do, given the TP group:
        without it megatron's default marks every TP rank's copy as the main replica, and a checkpoint at TP > 1
        fails to save (invalid access pattern)."""
        norm = self._modules.pop("post_layernorm")
        try:
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules["post_layernorm"] = norm
        return state | sharded_state_dict_default(norm, f"{prefix}post_layernorm.", sharded_offsets, metadata,
                                                  tp_group=self.tp_group)


def window_mask(attention_mask: torch.Tensor | None, length: int, window: int, device) -> torch.Tensor:
    """megatron's boolean mask (True = masked) that also hides keys `window` or more positions before the query (the
    query sees itself and window - 1 keys before it, as transformers' sliding_window_overlay); causal where no mask
    is given."""
    positions = torch.arange(length, device=device)
    offset = positions[:, None] - positions[None, :]  # query - key
    outside = offset >= window
    if attention_mask is None:
        return (outside | (offset < 0))[None, None]
    return attention_mask | outside


class WindowedAttention(DotProductAttention):
    """megatron's DotProductAttention over the last `window` keys of each query, within the mask it is given."""

    def __init__(self, *args, window: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        mask = window_mask(attention_mask, query.shape[0], self.window, query.device)
        return super().forward(query, key, value, mask, *args, **kwargs)


class Gemma3(DecoderFamily):
    name = "Gemma 3"
    architectures = ("Gemma3ForCausalLM", "gemma3_text")
    qk_norm = True
    model_class = Gemma3Model
    local_attention_only = True  # sliding windows: WindowedAttention (module docstring)

    def check_supported(self, hf: dict) -> None:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise ValueError(f"Gemma 3 with {key}={hf[key]} is not supported (soft-capping: null only)")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention=true is not supported (causal only)")
        if hf.get("attention_bias"):
            raise ValueError("Gemma 3 with attention_bias=true is not supported")
        if "sliding_window" in hf and hf["sliding_window"] is None:
            raise ValueError("Gemma 3 with sliding_window=null is not supported (its local layers need a window)")
        hf = with_defaults(hf)
        if hf["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 with hidden_activation={hf['hidden_activation']!r} is not supported "
                             "(gelu_pytorch_tanh only)")
        kinds = gemma3_layer_types(hf)
        if len(kinds) != hf["num_hidden_layers"] or not set(kinds) <= {SLIDING, FULL}:
            raise ValueError(f"Gemma 3 layer_types {kinds}: expected {hf['num_hidden_layers']} of {SLIDING!r} / "
                             f"{FULL!r}")
        rope = gemma3_rope(hf)
        _linear_factor(rope[FULL], "global")
        if rope[SLIDING]["rope_type"] != "default":
            raise ValueError(f"Gemma 3 with local RoPE scaling {rope[SLIDING]['rope_type']!r} is not supported")

    def transformer_config(self, hf: dict, *args, **kwargs):
        hf = with_defaults(hf)
        config = super().transformer_config(hf, *args, **kwargs)
        return dataclasses.replace(config, activation_func=partial(F.gelu, approximate="tanh"))

    def attention_config(self, hf: dict) -> dict:
        return dict(layernorm_zero_centered_gamma=True, softmax_scale=hf["query_pre_attn_scalar"] ** -0.5)

    def rope_kwargs(self, hf: dict) -> dict:
        full = gemma3_rope(hf)[FULL]
        kwargs = dict(rotary_base=float(full["rope_theta"]))
        factor = _linear_factor(full, "global")
        return kwargs if factor is None else {**kwargs, "seq_len_interpolation_factor": factor}

    def gpt_model_kwargs(self, hf: dict, tp: int) -> dict:
        hf = with_defaults(hf)
        return super().gpt_model_kwargs(hf, tp) | dict(
            local_rotary_base=float(gemma3_rope(hf)[SLIDING]["rope_theta"]))

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        hf = with_defaults(hf)
        spec = super().layer_spec(hf, layer)  # a new spec on every call: changed in place
        sliding = gemma3_layer_types(hf)[layer] == SLIDING
        attention = spec.submodules.self_attention
        attention.module, attention.params = Gemma3SelfAttention, {**attention.params, "sliding": sliding}
        if sliding:
            attention.submodules.core_attention = ModuleSpec(module=WindowedAttention,
                                                             params={"window": hf["sliding_window"]})
        spec.submodules.mlp = Gemma3MLP
        return spec

    def weight_maps(self, hf: dict, tp: int) -> list[WeightMap]:
        """The decoder's maps with Gemma's norm names: pre_mlp_layernorm is pre_feedforward_layernorm, and the
        attention's and MLP's post norms are post_attention_layernorm and post_feedforward_layernorm."""
        hf = with_defaults(hf)
        maps = []
        for m in super().weight_maps(hf, tp):
            if m.megatron.endswith(".pre_mlp_layernorm.weight"):
                m = dataclasses.replace(m, hf=(m.hf[0].replace("post_attention", "pre_feedforward"),))
            maps.append(m)
            if m.megatron.endswith(".self_attention.linear_proj.weight"):
                layer = m.megatron.split(".")[2]
                maps.append(WeightMap(f"decoder.layers.{layer}.self_attention.post_layernorm.weight",
                                      (f"model.layers.{layer}.post_attention_layernorm.weight",), **replicated()))
            if m.megatron.endswith(".mlp.linear_fc2.weight"):
                layer = m.megatron.split(".")[2]
                maps.append(WeightMap(f"decoder.layers.{layer}.mlp.post_layernorm.weight",
                                      (f"model.layers.{layer}.post_feedforward_layernorm.weight",), **replicated()))
        return maps


FAMILY = Gemma3()
