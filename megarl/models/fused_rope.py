"""RoPE in one kernel without TransformerEngine: megatron's apply_rope_fusion path, fed by a compiled function.

megatron's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd) makes about a dozen passes over the queries, and
again over the keys, in every layer: cos and sin of the table and their casts, t * cos, the rotate-half (a
chunk, a negation, a concatenation), a product, a sum, the concatenation with the unrotated part; as many in
backward. megatron fuses them only through TransformerEngine's kernel (config.apply_rope_fusion), which this
stack does not install. `install()` gives megatron a function of that kernel's signature instead, which
inductor makes one kernel each way on the GPU (megarl.utils.compiled; eager on the CPU). Like TE's kernel it
computes in float32 and rounds once; megatron's unfused path multiplies in the tensor's dtype."""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.utils.compiled import Compiled


def _rotate(t: Tensor, freqs: Tensor) -> Tensor:
    """t [s, b, heads, d] rotated by the angles freqs [s, b or 1, 1, r] (r <= d: the first r channels; megatron's
    table repeats the r / 2 frequencies twice, for the halves that rotate-half pairs)."""
    width = freqs.shape[-1]
    x = t[..., :width].float()
    first, second = x.chunk(2, dim=-1)
    out = (x * freqs.cos() + torch.cat((-second, first), dim=-1) * freqs.sin()).to(t.dtype)
    return torch.cat((out, t[..., width:]), dim=-1) if width < t.shape[-1] else out


_ROTATE = Compiled(_rotate, dynamic=True)


def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> Tensor:
    """megatron.core.extensions.transformer_engine.fused_apply_rotary_pos_emb's signature ('sbhd' layout)."""
    if interleaved:
        raise ValueError("megarl's fused RoPE rotates halves, not interleaved pairs (config.rotary_interleaved)")
    return _ROTATE(t, freqs)


def install() -> None:
    """megatron's fused-RoPE hook (rope_utils.fused_apply_rotary_pos_emb), where TransformerEngine left it empty."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
