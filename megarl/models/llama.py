"""Llama 3 / 3.1 / 3.2 / 3.3 (transformers' LlamaForCausalLM): no biases, plain or "llama3"-scaled RoPE,
tied embeddings (3.2 1B/3B) or not.

megatron's RotaryEmbedding implements the llama3 frequency adjustment (rope_scaling=True) with the
factor as its only argument: low_freq_factor=1, high_freq_factor=4 and
original_max_position_embeddings=8192 are fixed there. Every published Llama 3.x uses exactly those, so
they are accepted and anything else is refused rather than silently computed differently.
"""

from __future__ import annotations

from megarl.models.decoder import DecoderFamily, rope_parameters

# The llama3 RoPE parameters megatron-core 0.16 hard-codes in RotaryEmbedding._apply_scaling.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class Llama(DecoderFamily):
    name = "Llama"
    architectures = ("LlamaForCausalLM", "llama")

    def rope_kwargs(self, hf: dict) -> dict:
        params = rope_parameters(hf)
        if params["rope_type"] == "default":
            return dict(rotary_base=float(params["rope_theta"]))
        if params["rope_type"] != "llama3":
            raise ValueError(f"Llama with RoPE scaling {params['rope_type']!r} is not supported (default or llama3)")
        fixed = {k: params.get(k) for k in MEGATRON_LLAMA3_ROPE}
        if any(fixed[k] is None or float(fixed[k]) != v for k, v in MEGATRON_LLAMA3_ROPE.items()):
            raise ValueError(f"llama3 RoPE with {fixed} is not supported: megatron-core fixes {MEGATRON_LLAMA3_ROPE}")
        return dict(rotary_base=float(params["rope_theta"]), rope_scaling=True,
                    rope_scaling_factor=float(params["factor"]))


FAMILY = Llama()
