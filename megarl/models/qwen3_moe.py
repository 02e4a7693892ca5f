"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): Qwen3 attention (QK-norm, no biases) with a mixture-of-experts MLP
in every layer (moe.py: routing, dispatch, EP), the top-k weights renormalised where norm_topk_prob is set."""

from __future__ import annotations

from megarl.models.moe import SoftmaxTopKMoe


class Qwen3Moe(SoftmaxTopKMoe):
    name = "Qwen3-MoE"
    architectures = ("Qwen3MoeForCausalLM", "qwen3_moe")
    qk_norm = True

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                             "supported: every layer must be a mixture of experts")

    def renormalises(self, hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", False))


FAMILY = Qwen3Moe()
