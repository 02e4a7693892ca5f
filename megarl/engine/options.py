"""megatron-core's configs from a role's section (actor, critic, reward_model): the TransformerConfig's engine
options (sequence and context parallelism, virtual pipeline, recompute, router bias updates, fused kernels and
gradient-accumulation fusion), the optimizer's config, the parameters' dtype."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig

from megarl.config import EngineConfig
from megarl.engine import apex_ops
from megarl.models import fused_ops
from megarl.models.router import expert_bias_update_options
from megarl.parallel.stages import stage_layers


def with_engine_options(config, section: EngineConfig):
    """The family's TransformerConfig plus the engine's own options: sequence and context parallelism, virtual
    pipeline, recompute."""
    options = {}
    if parallel_state.get_context_parallel_world_size() > 1:
        options["context_parallel_size"] = parallel_state.get_context_parallel_world_size()
    if section.parallel.sequence_parallel and config.tensor_model_parallel_size > 1:  # TP=1: nothing to split
        options["sequence_parallel"] = True
    if section.parallel.vpp > 1:
        p = section.parallel
        stage_layers(config.num_layers, p.pp, p.pp_first_stage_layers, p.pp_last_stage_layers, p.vpp)
        options["virtual_pipeline_model_parallel_size"] = section.parallel.vpp
        # Measured: on gloo, the interleaved schedule's batched isend/irecv hands later micro-batches the
        # activations of earlier ones (training only); one-by-one p2p ops are correct. NCCL batches fine.
        if dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == "gloo":
            options["batch_p2p_comm"] = False
    if section.recompute == "full":
        options |= dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif section.recompute == "selective":
        options |= dict(recompute_granularity="selective", recompute_modules=section.recompute_modules or ["core_attn"])
    elif section.recompute != "none":
        raise ValueError(f"recompute={section.recompute!r}: expected none, full or selective")
    if section.moe_router_bias_update_rate:
        options |= expert_bias_update_options(config, section.moe_router_bias_update_rate)
    return dataclasses.replace(config, **options) if options else config


def with_fused_kernels(config, section: EngineConfig, device: str):
    """On the GPU, with section.fused_kernels: SwiGLU (bias_activation_fusion, each way one pass instead of four or
    five over the MLP's widest activations) and plain RoPE (apply_rope_fusion; not multi-latent attention's,
    M-RoPE's or interleaved pairs, which keep megatron's path) as megarl's Triton kernels (models/fused_ops.py),
    where they build and compute right on this GPU (probed once).
    Mixture-of-experts models keep megatron's unfused SwiGLU: their experts take the routing weights into it
    (megatron's weighted variant, compiled per expert's token count), which has not run on a GPU here.
    And gradient-accumulation fusion, where torch can add the weight gradients' GEMMs into the float32 main_grad
    (engine/apex_ops.py). The CPU runs megatron's unfused ops."""
    if device != "cuda" or not section.fused_kernels:
        return config
    options = {}
    if fused_ops.available(device):
        fused_ops.install()
        if config.gated_linear_unit and config.activation_func is F.silu and not config.num_moe_experts:
            options["bias_activation_fusion"] = True
        if not (config.multi_latent_attention or config.mrope_section or config.rotary_interleaved):
            options["apply_rope_fusion"] = True
    if apex_ops.wgrad_fusion_available(device, config.params_dtype):
        options["gradient_accumulation_fusion"] = True
    return dataclasses.replace(config, **options) if options else config


def optimizer_config(section: EngineConfig, params_dtype: torch.dtype, device: torch.device) -> OptimizerConfig:
    """megatron's Adam (AdamW: decoupled weight decay) over the role's optim section, optionally distributed over
    DP and with its state in host memory (section.optimizer_cpu_offload)."""
    o = section.optim
    if section.optimizer_cpu_offload and not section.use_distributed_optimizer:
        raise ValueError("optimizer_cpu_offload needs use_distributed_optimizer (megatron offloads the distributed "
                         "optimizer's state)")
    # On the CPU the state is in host memory already (and megatron's HybridDeviceOptimizer moves GPU tensors only).
    offload = section.optimizer_cpu_offload and device.type == "cuda"
    return OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                           adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                           clip_grad=o.clip_grad, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
                           use_distributed_optimizer=section.use_distributed_optimizer, optimizer_cpu_offload=offload,
                           optimizer_offload_fraction=section.optimizer_offload_fraction if offload else 0.0)


def precision_dtype(precision: str, device: str) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
