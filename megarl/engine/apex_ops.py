"""What megatron-core takes from apex (or TransformerEngine) where one is installed, made of torch ops for this
stack, which has neither.

- The optimizer's multi-tensor ops. Without apex, megatron falls back to loops in Python
  (megatron.core.utils.local_multi_tensor_*): the gradient norm takes one `torch.norm` per parameter and then
  builds a host tensor from the list of norms, a device-to-host copy per parameter; clipping, and the copy of the
  float32 main parameters into the bf16 model after every step, take two kernels per parameter each. For a
  0.5B model (~170 tensors) that is ~1,000 kernel launches and ~170 waits for the GPU in every optimizer step,
  where a small model's update is bound by the host's launches. torch's foreach ops do each in a handful.
- Gradient-accumulation fusion (config.gradient_accumulation_fusion): the weight gradient of every linear layer
  added into its float32 main_grad by the GEMM itself, which apex's fused_weight_gradient_mlp_cuda does; without
  it megatron computes a bf16 gradient that DDP's hook then adds: a kernel, an allocation and a hook's add per
  weight and micro-batch more. torch's addmm with out_dtype=float32 accumulates bf16 products into a float32
  matrix on the GPU, where the torch build accepts a float32 `self` (newer ones do; probed once)."""

from __future__ import annotations

import functools
import types

import torch


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm: the L2 norm over every tensor of tensor_lists[0], a float32 tensor of one element
    on their device (and each tensor's norm if per_tensor)."""
    norms = torch.stack(torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale: tensor_lists[1][i] = tensor_lists[0][i] * scale, in the targets' dtype (megatron
    copies main parameters into the model with scale 1 and clips gradients in place with the same list twice)."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if sources is targets:
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, sources if scale == 1.0 else torch._foreach_mul(sources, scale))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32: main_grad (float32) += grad_output^T @ total_input,
    the products of bf16 (or float32) activations accumulated in float32 by the GEMM."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same into a main_grad of the activations' own 16-bit dtype (DDP with grad_reduce_in_fp32=False)."""
    main_grad.addmm_(grad_output.t(), total_input)


@functools.cache
def wgrad_fusion_available(device: str, dtype: torch.dtype) -> bool:
    """Whether this torch accumulates products of `dtype` into a float32 matrix in place on `device`: always for
    float32; for bf16 and fp16 only on the GPU, and only where addmm(out_dtype=float32) takes a float32 `self`
    (probed here on 64 x 64 ones, so a build that refuses it, or rounds the sum to 16 bits, keeps megatron's path).
    The CPU runs megatron's unfused path (the engine enables the fusion with actor.fused_kernels, a GPU option)."""
    if dtype == torch.float32:
        return True
    if device != "cuda":
        return False
    a = torch.ones(64, 64, dtype=dtype, device=device)
    accumulated = torch.full((64, 64), 1 / 1024, dtype=torch.float32, device=device)  # lost if rounded to bf16
    try:
        wgrad_gemm_accum_fp32(a, a, accumulated)
    except (RuntimeError, TypeError):
        return False
    return bool((accumulated == 64 + 1 / 1024).all())


def install(wgrad_fusion: bool = False) -> None:
    """Give megatron these ops where it fell back to its Python loops (never over apex's or TE's), and, with
    wgrad_fusion, the gradient-accumulation GEMMs its linear layers import from apex."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale
    if wgrad_fusion and not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
            wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)
        layers._grad_accum_fusion_available = True
