"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM): biases on q/k/v only, optionally tied embeddings,
plain RoPE."""

from __future__ import annotations

from megarl.models.decoder import DecoderFamily


class Qwen2(DecoderFamily):
    name = "Qwen2"
    architectures = ("Qwen2ForCausalLM", "qwen2")
    qkv_bias = True


FAMILY = Qwen2()
