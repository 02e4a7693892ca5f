"""Norms of the local layer spec that also run under sequence parallelism (SP), without TransformerEngine.

megatron's WrappedTorchNorm (torch RMSNorm/LayerNorm) refuses `sequence_parallel`. Nothing in the norm
itself needs TE: under SP each TP rank normalises its own slice of the tokens, so a norm's weight gets a
partial gradient there, and megatron's finalize_model_grads sums across TP the gradients of exactly the
parameters marked `sequence_parallel=True` (as TE's norms and megatron's MoE router mark theirs).
HiddenNorm (input, pre-MLP and final norms, which see the SP slice) marks its weight; HeadNorm (QK-norm
over head_dim, which sees every token of this rank's heads) does not: megatron sums its gradient across
TP by name (q_layernorm / k_layernorm) with or without SP.
Under config.layernorm_zero_centered_gamma (Qwen3.5) an RMSNorm scales by (1 + weight), its weight stored around 0;
GateNorm (the gated delta net's norm over a value head) always scales by its weight, as Qwen3.5's does.
"""

from __future__ import annotations

import torch

NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by (1 + weight), in float32 whatever the input's dtype (transformers' Qwen3.5 order)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class HiddenNorm:
    """Built by megatron's build_module as WrappedTorchNorm is: (config, hidden_size, eps) -> a torch norm."""

    over_sequence_slice = True
    follows_zero_centering = True

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization not in NORMS:
            raise ValueError(f"normalization={config.normalization!r}: expected one of {', '.join(NORMS)}")
        if config.layernorm_zero_centered_gamma and cls.follows_zero_centering:
            if config.normalization != "RMSNorm":
                raise ValueError("layernorm_zero_centered_gamma: megarl has the zero-centred RMSNorm only")
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        else:
            norm = NORMS[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel and cls.over_sequence_slice)
        return norm


class HeadNorm(HiddenNorm):
    over_sequence_slice = False


class GateNorm(HeadNorm):
    follows_zero_centering = False
