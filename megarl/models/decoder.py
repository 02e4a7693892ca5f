"""The Llama-style decoder shared by every family: RMSNorm, SwiGLU MLP (dense or mixture of experts),
RoPE, grouped-query attention, optionally tied embeddings, on megatron's GPTModel with the local spec
(its norms swapped for norm.py's, which also run under sequence parallelism; decoder_block_spec adds the
final norm).

A family is a DecoderFamily subclass that switches on what it differs in (q/k/v biases, QK-norm, RoPE
scaling, experts, a vision tower: model_class and with_model_inputs). Its four methods are what the engine calls:
  transformer_config(hf, tp, pp, params_dtype, use_cpu_initialization, ep=1, etp=None, first_stage_layers=0,
                     last_stage_layers=0) -> TransformerConfig
  layer_spec(hf, layer) -> megatron ModuleSpec of decoder layer `layer` (its GLOBAL 0-based index: layers may
                           differ, e.g. DeepSeek's dense first layers before its mixture-of-experts ones)
  gpt_model_kwargs(hf, tp) -> keyword arguments of GPTModel (vocab, RoPE, tying)
  weight_maps(hf, tp) -> [WeightMap]: every megatron parameter, the HF tensors it is made of, and how to
                         cut its tensor-parallel shard from them and put the shards back
`hf` is the config.json dict.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.norm import HeadNorm, HiddenNorm
from megarl.models.sharding import (WeightMap, fused_gate_up, fused_qkv, padded_vocab_size, replicated,
                                    split_dim, vocab_rows)
from megarl.parallel.stages import stage_layers
from megarl.utils.hf_config import language_fields


text_config = language_fields  # the language model's fields of a (multimodal) config.json


def head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def rope_parameters(hf: dict) -> dict:
    """rope_type, rope_theta and the scaling parameters, from either config.json spelling: transformers
    >= 5 writes `rope_parameters`; older files (the published Llama 3.x, Qwen2.5) `rope_theta` and
    `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class DecoderFamily:
    name = "decoder"
    architectures: tuple[str, ...] = ()  # HF `architectures` entries and `model_type` values it serves
    qkv_bias = False
    qk_norm = False
    partial_rotary_factor = 1.0  # the share of each head RoPE rotates where config.json names none
    model_class = GPTModel  # a multimodal family's subclass takes its extra inputs as forward keywords
    # its layer specs bring a core attention of their own that SDPAttention does not compute (Gemma 3's windows):
    # the engine runs actor.attention=local only (attention.resolve_core_attention)
    local_attention_only = False

    def with_model_inputs(self, hf: dict, batch):
        """The batch with what the family's model needs beyond token ids (M-RoPE positions, images); as is here."""
        return batch

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # --- what a family may override ----------------------------------------------------------

    def has_qkv_bias(self, hf: dict) -> bool:
        """q/k/v biases: the family's own setting (qkv_bias) unless it reads the config's (GLM-4.5's attention_bias)."""
        return self.qkv_bias

    def has_qk_norm(self, hf: dict) -> bool:
        """QK-norm: the family's own setting (qk_norm) unless it reads the config's (GLM-4.5's use_qk_norm)."""
        return self.qk_norm

    def check_supported(self, hf: dict) -> None:
        if hf.get("use_sliding_window"):
            raise ValueError(f"{self.name} with use_sliding_window=true is not supported (full attention only)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{self.name} with hidden_act={hf['hidden_act']!r} is not supported (silu only)")
        if not self.has_qkv_bias(hf) and hf.get("attention_bias"):
            raise ValueError(f"{self.name} with attention_bias=true is not supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{self.name} with mlp_bias=true is not supported")

    def rope_kwargs(self, hf: dict) -> dict:
        """GPTModel's RoPE arguments: plain RoPE over partial_rotary_factor of each head (rotate-half over the
        leading channels, as transformers and megatron's rotary_percent both do) unless the family overrides this."""
        params = rope_parameters(hf)
        if params["rope_type"] != "default":
            raise ValueError(f"{self.name} with RoPE scaling {params['rope_type']!r} is not supported")
        fraction = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", self.partial_rotary_factor)))
        kwargs = dict(rotary_base=float(params["rope_theta"]))
        return kwargs if fraction == 1.0 else {**kwargs, "rotary_percent": fraction}

    def moe_config(self, hf: dict, ep: int) -> dict:
        """TransformerConfig fields of the experts; dense families have none."""
        if ep > 1:
            raise ValueError(f"expert parallelism (EP={ep}) needs a mixture-of-experts model; {self.name} is dense")
        return {}

    def num_experts(self, hf: dict) -> int | None:
        return None

    def attention_config(self, hf: dict) -> dict:
        """TransformerConfig fields of a family's own attention and norms (Qwen3.5's); none here."""
        return {}

    def attention_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        """Grouped-query attention: q/k/v fused into linear_qkv, optional biases and QK-norm."""
        qkv = fused_qkv(hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf))
        attn, hf_attn = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.self_attn."
        maps = [WeightMap(attn + "linear_qkv.weight", tuple(hf_attn + f"{p}_proj.weight" for p in "qkv"), **qkv),
                WeightMap(attn + "linear_proj.weight", (hf_attn + "o_proj.weight",), **split_dim(1))]
        if self.has_qkv_bias(hf):
            maps.append(WeightMap(attn + "linear_qkv.bias", tuple(hf_attn + f"{p}_proj.bias" for p in "qkv"), **qkv))
        if self.has_qk_norm(hf):
            # Per-head RMSNorm over head_dim, the same weight for every head: replicated.
            maps += [WeightMap(attn + "q_layernorm.weight", (hf_attn + "q_norm.weight",), **replicated()),
                     WeightMap(attn + "k_layernorm.weight", (hf_attn + "k_norm.weight",), **replicated())]
        return maps

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        return [WeightMap(m + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"), **fused_gate_up()),
                WeightMap(m + "linear_fc2.weight", (h + "down_proj.weight",), **split_dim(1))]

    # --- the engine's interface ----------------------------------------------------------------

    def transformer_config(self, hf: dict, tp: int, pp: int, params_dtype: torch.dtype,
                           use_cpu_initialization: bool, ep: int = 1, etp: int | None = None,
                           first_stage_layers: int = 0, last_stage_layers: int = 0) -> TransformerConfig:
        """etp: the experts' tensor-parallel size (None = tp); first/last_stage_layers: uneven pipeline stages
        (0 = an even share; megarl/parallel/stages.py has the rule)."""
        self.check_supported(hf)
        if hf["num_key_value_heads"] % tp:
            raise ValueError(f"TP={tp} must divide num_key_value_heads={hf['num_key_value_heads']} "
                             f"(each TP rank holds whole query groups)")
        stage_layers(hf["num_hidden_layers"], pp, first_stage_layers, last_stage_layers)
        return TransformerConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
            kv_channels=head_dim(hf), ffn_hidden_size=hf["intermediate_size"],
            normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"], qk_layernorm=self.has_qk_norm(hf),
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=self.has_qkv_bias(hf),
            hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            num_layers_in_first_pipeline_stage=first_stage_layers or None,
            num_layers_in_last_pipeline_stage=last_stage_layers or None,
            params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
            # The checkpoint overwrites megatron's random init, but keep it: megatron marks the
            # tensor-parallel attributes of weights only in its init functions, and the grad norm
            # (and anything else that tells TP shards from replicas) needs them.
            use_cpu_initialization=use_cpu_initialization, perform_initialization=True,
            # Fused kernels are GPU/apex-only; the local spec uses the unfused torch paths.
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False,
            # megatron's default scope, "full", is its deprecated spelling of this one (and warns in every rank);
            # megarl captures no CUDA graphs in training either way
            cuda_graph_scope=[],
            **self.moe_config(hf, ep), **self.attention_config(hf))

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        """megatron's local spec with norms that also run under sequence parallelism (norm.py); every layer alike."""
        spec = get_gpt_layer_local_spec(num_experts=self.num_experts(hf), qk_layernorm=self.has_qk_norm(hf),
                                        normalization="RMSNorm")
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = HiddenNorm
        if self.has_qk_norm(hf):
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = HeadNorm
        return spec

    def gpt_model_kwargs(self, hf: dict, tp: int) -> dict:
        return dict(vocab_size=padded_vocab_size(hf["vocab_size"], tp),
                    max_sequence_length=hf["max_position_embeddings"], position_embedding_type="rope",
                    share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
                    **self.rope_kwargs(hf))

    def weight_maps(self, hf: dict, tp: int) -> list[WeightMap]:
        """Every megatron parameter (global layer and expert indices) with the HF tensors it is made of."""
        vocab = vocab_rows(hf["vocab_size"], tp)
        maps = [WeightMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), **vocab)]
        for i in range(hf["num_hidden_layers"]):
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            maps.append(WeightMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), **replicated()))
            maps += self.attention_maps(hf, tp, i)
            maps.append(WeightMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), **replicated()))
            maps += self.mlp_maps(hf, tp, i)
        maps.append(WeightMap("decoder.final_layernorm.weight", ("model.norm.weight",), **replicated()))
        if hf.get("tie_word_embeddings"):
            # With PP > 1 the last stage holds its own copy of the embedding as the output layer.
            maps.append(WeightMap("output_layer.weight", ("model.embed_tokens.weight",), export=False, **vocab))
        else:
            maps.append(WeightMap("output_layer.weight", ("lm_head.weight",), **vocab))
        return maps


def decoder_block_spec(layer_spec: Callable[[int], ModuleSpec], config: TransformerConfig,
                       vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """GPTModel's decoder for this pipeline stage (or virtual stage): `layer_spec(global layer index)` for each of
    its layers (megatron numbers them from the stage's offset, even or uneven stages alike) and a final norm
    that runs under sequence parallelism (given a layer spec, megatron picks WrappedTorchNorm)."""
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(first + i) for i in range(count)], layer_norm=HiddenNorm)
