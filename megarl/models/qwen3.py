"""Qwen3 dense (transformers' Qwen3ForCausalLM): no biases, QK-norm (a per-head RMSNorm over head_dim on
queries and keys before RoPE: megatron's qk_layernorm), head_dim independent of hidden_size."""

from __future__ import annotations

from megarl.models.decoder import DecoderFamily


class Qwen3(DecoderFamily):
    name = "Qwen3"
    architectures = ("Qwen3ForCausalLM", "qwen3")
    qk_norm = True


FAMILY = Qwen3()
