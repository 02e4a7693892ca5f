"""Norms of the local layer spec that also run under sequence parallelism (SP), without TransformerEngine.

megatron's WrappedTorchNorm (torch RMSNorm/LayerNorm) refuses `sequence_parallel`. Nothing in the norm
itself needs TE: under SP each TP rank normalises its own slice of the tokens, so a norm's weight gets a
partial gradient there, and megatron's finalize_model_grads sums across TP the gradients of exactly the
parameters marked `sequence_parallel=True` (as TE's norms and megatron's MoE router mark theirs).
HiddenNorm (input, pre-MLP and final norms, which see the SP slice) marks its weight; HeadNorm (QK-norm
over head_dim, which sees every token of this rank's heads) does not: megatron sums its gradient across
TP by name (q_layernorm / k_layernorm) with or without SP.
"""

from __future__ import annotations

import torch

NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class HiddenNorm:
    """Built by megatron's build_module as WrappedTorchNorm is: (config, hidden_size, eps) -> a torch norm."""

    over_sequence_slice = True

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization not in NORMS:
            raise ValueError(f"normalization={config.normalization!r}: expected one of {', '.join(NORMS)}")
        norm = NORMS[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel and cls.over_sequence_slice)
        return norm


class HeadNorm(HiddenNorm):
    over_sequence_slice = False
