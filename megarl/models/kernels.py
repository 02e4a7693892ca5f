"""RoPE and SwiGLU as Triton kernels launched directly: one kernel each way, and little host time per call.

At a small model and 10k-token micro-batches the update is bound by the host's launches (docs/benchmarks.md):
the same two operations compiled by torch.compile cost ~0.2 ms of host time per call in Dynamo's guards and
AOTAutograd's wrappers, six calls per layer and micro-batch. Here each is a Triton kernel and an
autograd.Function around it: float32 inside, one rounding on the way out (as TransformerEngine's and inductor's
kernels). Triton is imported at the first call: the CPU install has none, and the CPU tests run these kernels under
Triton's interpreter (TRITON_INTERPRET=1, read when the kernels are made)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def _triton():
    """(triton, the RoPE kernel, the SwiGLU kernel), made once per process."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(x_ptr, f_ptr, out_ptr, batch, heads, sx_s, sx_b, sx_h, sf_s, sf_b, HALF: tl.constexpr,
                    PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                    BACKWARD: tl.constexpr):
        # One token (s, b) and BLOCK_H heads a program. Channel j < HALF pairs with j + HALF (rotate-half); each
        # half has its own angles (megatron's table repeats them, but nothing here relies on it).
        token = tl.program_id(0).to(tl.int64)
        s, b = token // batch, token % batch
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_R)
        f = f_ptr + s * sf_s + b * sf_b + j
        f1 = tl.load(f, mask=j < HALF, other=0.0).to(tl.float32)
        f2 = tl.load(f + HALF, mask=j < HALF, other=0.0).to(tl.float32)
        c1, c2 = tl.cos(f1)[None, :], tl.cos(f2)[None, :]
        if BACKWARD:  # the rotation's transpose: dx1 = c1 g1 + s2 g2, dx2 = c2 g2 - s1 g1
            a, bb = tl.sin(f2)[None, :], -tl.sin(f1)[None, :]
        else:  # x1 c1 - x2 s1, x2 c2 + x1 s2
            a, bb = -tl.sin(f1)[None, :], tl.sin(f2)[None, :]
        mask = (h[:, None] < heads) & (j[None, :] < HALF)
        x = x_ptr + s * sx_s + b * sx_b + h[:, None].to(tl.int64) * sx_h + j[None, :]
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
        out = out_ptr + (token * heads + h[:, None]) * (2 * HALF + PASS) + j[None, :]
        tl.store(out, (x1 * c1 + x2 * a).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, (x2 * c2 + x1 * bb).to(out_ptr.dtype.element_ty), mask=mask)
        if PASS > 0:  # channels past the rotary width: through unchanged, both ways
            p = tl.arange(0, BLOCK_P)
            mask = (h[:, None] < heads) & (p[None, :] < PASS)
            rest = tl.load(x_ptr + s * sx_s + b * sx_b + h[:, None].to(tl.int64) * sx_h + 2 * HALF + p[None, :],
                           mask=mask)
            tl.store(out_ptr + (token * heads + h[:, None]) * (2 * HALF + PASS) + 2 * HALF + p[None, :], rest,
                     mask=mask)

    @triton.jit
    def swiglu_kernel(y_ptr, g_ptr, out_ptr, width, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
        # y [rows, 2 * width] = (gate, up); forward silu(gate) * up, backward (d gate, d up) from g [rows, width].
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        y = y_ptr + row * 2 * width + cols
        gate = tl.load(y, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(y + width, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        if BACKWARD:
            g = tl.load(g_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
            out = out_ptr + row * 2 * width + cols
            tl.store(out, (g * sig * (1 + gate * (1 - sig)) * up).to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out + width, (g * gate * sig).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + row * width + cols, (gate * sig * up).to(out_ptr.dtype.element_ty), mask=mask)

    return triton, rope_kernel, swiglu_kernel


def _rope(x: Tensor, freqs: Tensor, backward: bool) -> Tensor:
    triton, kernel, _ = _triton()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if freqs.stride(-1) != 1:
        freqs = freqs.contiguous()
    s, b, heads, d = x.shape
    rotary = freqs.shape[-1]
    block_h = min(triton.next_power_of_2(heads), 16)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kernel[(s * b, triton.cdiv(heads, block_h))](
        x, freqs, out, b, heads, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0),
        freqs.stride(1) if freqs.shape[1] > 1 else 0, HALF=rotary // 2, PASS=d - rotary, BLOCK_H=block_h,
        BLOCK_R=triton.next_power_of_2(rotary // 2), BLOCK_P=triton.next_power_of_2(max(d - rotary, 1)),
        BACKWARD=backward)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs):
        ctx.save_for_backward(freqs)
        return _rope(x, freqs, backward=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _rope(grad, freqs, backward=True), None


def rope(x: Tensor, freqs: Tensor) -> Tensor:
    """x [s, b, heads, d] rotated by the angles freqs [s, b or 1, 1, r] (r <= d, even: the first r channels, halves
    paired as megatron's rotate-half; the rest pass through). A new contiguous tensor of x's dtype."""
    if x.dim() != 4 or freqs.dim() != 4 or freqs.shape[-1] % 2 or freqs.shape[-1] > x.shape[-1] \
            or freqs.shape[0] < x.shape[0] or freqs.shape[1] not in (1, x.shape[1]):
        raise ValueError(f"rope: x {tuple(x.shape)} [s, b, heads, d] and freqs {tuple(freqs.shape)} "
                         "[s, b or 1, 1, r] with an even r <= d")
    return _Rope.apply(x, freqs)


def _swiglu(y: Tensor, grad: Tensor | None) -> Tensor:
    triton, _, kernel = _triton()
    rows, width = y.shape[0], y.shape[1] // 2
    out = torch.empty((rows, width if grad is None else 2 * width), dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(width), 1024)
    kernel[(rows, triton.cdiv(width, block))](y, y if grad is None else grad, out, width, BLOCK=block,
                                              BACKWARD=grad is not None)
    return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return _swiglu(y, None)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return _swiglu(y, grad.contiguous())


def swiglu(y: Tensor) -> Tensor:
    """silu(gate) * up for y [rows, 2 * width] = (gate, up) along the last dimension: [rows, width]."""
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"swiglu: y {tuple(y.shape)}: expected [rows, 2 * width]")
    return _SwiGLU.apply(y.contiguous())
