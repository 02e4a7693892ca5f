"""Qwen2 / Qwen2.5 (transformers' Qwen2Config, Qwen2ForCausalLM) on megatron's GPTModel (local spec).

Qwen2 = RMSNorm, SwiGLU MLP, RoPE, grouped-query attention with biases on q/k/v only, optionally
tied input/output embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.sharding import (WeightMap, fused_gate_up, fused_qkv, padded_vocab_size, replicated,
                                    split_dim, vocab_rows)


def _head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _rope_theta(hf: dict) -> float:
    # transformers >= 5 writes rope_parameters; older config.json files (the published Qwen2.5) rope_theta.
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" or hf.get("rope_scaling"):
        raise ValueError(f"Qwen2 with RoPE scaling ({rope_type}, {hf.get('rope_scaling')}) is not supported")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _check_supported(hf: dict) -> None:
    if hf.get("use_sliding_window"):
        raise ValueError("Qwen2 with use_sliding_window=true is not supported (full attention only)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Qwen2 with hidden_act={hf['hidden_act']!r} is not supported (silu only)")


def transformer_config(hf: dict, tp: int, pp: int, params_dtype: torch.dtype,
                       use_cpu_initialization: bool) -> TransformerConfig:
    _check_supported(hf)
    if hf["num_key_value_heads"] % tp:
        raise ValueError(f"TP={tp} must divide num_key_value_heads={hf['num_key_value_heads']} "
                         f"(each TP rank holds whole query groups)")
    if hf["num_hidden_layers"] % pp:
        raise ValueError(f"PP={pp} must divide num_hidden_layers={hf['num_hidden_layers']}")
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=_head_dim(hf), ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        # The checkpoint overwrites megatron's random init, but keep it: megatron marks the
        # tensor-parallel attributes of weights only in its init functions, and the grad norm
        # (and anything else that tells TP shards from replicas) needs them.
        use_cpu_initialization=use_cpu_initialization, perform_initialization=True,
        # Fused kernels are GPU/apex-only; the local spec uses the unfused torch paths.
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)


def gpt_model_kwargs(hf: dict, tp: int) -> dict:
    return dict(vocab_size=padded_vocab_size(hf["vocab_size"], tp),
                max_sequence_length=hf["max_position_embeddings"], position_embedding_type="rope",
                rotary_base=_rope_theta(hf), share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")))


def weight_maps(hf: dict, tp: int) -> list[WeightMap]:
    """Every megatron parameter (global layer index) with the HF tensors it is made of."""
    vocab = vocab_rows(hf["vocab_size"], tp)
    qkv = fused_qkv(hf["num_attention_heads"], hf["num_key_value_heads"], _head_dim(hf))
    maps = [WeightMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), **vocab)]
    for i in range(hf["num_hidden_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        maps += [
            WeightMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), **replicated()),
            WeightMap(m + "self_attention.linear_qkv.weight",
                      tuple(attn + f"{p}_proj.weight" for p in "qkv"), **qkv),
            WeightMap(m + "self_attention.linear_qkv.bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), **qkv),
            WeightMap(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), **split_dim(1)),
            WeightMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), **replicated()),
            WeightMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                      **fused_gate_up()),
            WeightMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), **split_dim(1)),
        ]
    maps.append(WeightMap("decoder.final_layernorm.weight", ("model.norm.weight",), **replicated()))
    if hf.get("tie_word_embeddings"):
        # With PP > 1 the last stage holds its own copy of the embedding as the output layer.
        maps.append(WeightMap("output_layer.weight", ("model.embed_tokens.weight",), export=False, **vocab))
    else:
        maps.append(WeightMap("output_layer.weight", ("lm_head.weight",), **vocab))
    return maps
