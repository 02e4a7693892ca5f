"""megatron's fusion hooks for RoPE and SwiGLU, fed by megarl's Triton kernels (models/kernels.py); RoPE's only where
no TransformerEngine filled it.

megatron's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd) makes about a dozen passes over the queries, and
again over the keys, in every layer, as many in backward; it fuses them only through TransformerEngine's kernel
(config.apply_rope_fusion). Its fused SwiGLU (config.bias_activation_fusion) is a torch.compile'd function, one
kernel each way but ~0.2 ms of host time per call in Dynamo's and AOTAutograd's wrappers. `install()` gives
megatron's RoPE hook a function of TE's kernel's signature, and its MLP a SwiGLU of the same signature as its own,
both one Triton kernel each way launched directly. The engine installs them on the GPU only (with_fused_kernels)."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import mlp
from torch import Tensor

from megarl.models import kernels


def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> Tensor:
    """megatron.core.extensions.transformer_engine.fused_apply_rotary_pos_emb's signature ('sbhd' layout)."""
    if interleaved:
        raise ValueError("megarl's fused RoPE rotates halves, not interleaved pairs (config.rotary_interleaved)")
    return kernels.rope(t, freqs)


def fused_swiglu(input: Tensor, bias: Tensor | None, fp8_input_store: bool = False,
                 cpu_offload_input: bool = False) -> Tensor:
    """megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl's signature; with a bias, an fp8 input store or the
    input offloaded (none of which megarl's models use), megatron's own."""
    if bias is not None or fp8_input_store or cpu_offload_input:
        return fused_bias_swiglu.bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)
    return kernels.swiglu(input.reshape(-1, input.shape[-1])).view(*input.shape[:-1], -1)


@functools.cache
def available(device: str) -> bool:
    """Whether the kernels build and compute megatron's results on `device` ('cuda': this rank's GPU), probed once
    per process on a few tokens, forward and backward. Triton needs a GPU it supports and a C compiler for its
    launcher; where either is missing megatron's unfused ops stay, and a warning says why."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 2, 2, 8, generator=g), torch.randn(3, 16, generator=g)
    freqs = torch.rand(3, 1, 1, 6, generator=g) * 10
    try:
        x, y, freqs = x.to(device).requires_grad_(), y.to(device).requires_grad_(), freqs.to(device)
        rotated, gated = kernels.rope(x, freqs), kernels.swiglu(y)
        (rotated.sum() + gated.sum()).backward()
        gate, up = y.detach().chunk(2, -1)
        right = torch.allclose(rotated, rope_utils._apply_rotary_pos_emb_bshd(x.detach(), freqs), atol=1e-4) and \
            torch.allclose(gated, F.silu(gate) * up, atol=1e-4) and bool(x.grad.isfinite().all())
        problem = None if right else "results differ from megatron's unfused ops"
    except Exception as error:  # a compiler, driver or device error of any kind: the unfused ops still run
        problem = f"{type(error).__name__}: {error}"
    if problem:
        warnings.warn(f"megarl's Triton kernels for RoPE and SwiGLU do not run on {device} ({problem}); "
                      "megatron's unfused ops stay (actor.fused_kernels)")
    return problem is None


def install() -> None:
    """megatron's fused-RoPE hook (rope_utils.fused_apply_rotary_pos_emb), where TransformerEngine left it empty, and
    the SwiGLU its MLP calls under bias_activation_fusion."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    mlp.bias_swiglu_impl = fused_swiglu
