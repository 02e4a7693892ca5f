"""The policy's LoRA adapters (megarl/engine/lora.py) as a PEFT adapter directory: adapter_config.json and
adapter_model.safetensors, what peft's PeftModel.from_pretrained and SGLang's /load_lora_adapter read.

Each HF projection's A [rank, in] and B [out, rank] whole (a TP-split matrix gathered along its split axis, the
pipeline stages' layers gathered), under peft's key for the projection's HF module:
base_model.model.<module>.lora_A.weight and .lora_B.weight (the module named by the family's weight map, e.g.
model.layers.0.self_attn.q_proj). adapter_config.json records the rank, alpha, dropout, the projections adapted and
the base model's path (base_model_name_or_path). peft's forward is W x + (alpha / r) B A x, the policy's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def adapter_tensors(engine) -> dict[str, torch.Tensor]:
    """Every adapter matrix whole, on the CPU, by its PEFT key; the same on every rank. Collective over the TP and
    pipeline groups: every rank calls it."""
    from megatron.core import parallel_state  # here: the rollout engines read and merge adapters without megatron

    from megarl.engine import weights

    lora = engine.lora
    by_megatron = {wm.megatron: wm for wm in engine.weight_maps}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, param in sorted(weights.global_parameters(engine.gpts).items()):
        layer = lora.layers.get(id(param))
        if layer is None:
            continue
        hf = by_megatron[name].hf
        for proj, adapter in layer.adapters.items():
            module = next((n.removesuffix(".weight") for n in hf if n.endswith(f".{proj}.weight")), None)
            if module is None:
                raise ValueError(f"{name}: the family's weight map names no {proj} among {list(hf)}; its adapters have "
                                 "no PEFT name")
            for which, matrix in (("A", adapter.A), ("B", adapter.B)):
                out[f"{PREFIX}{module}.lora_{which}.weight"] = _whole(matrix, tp_group).cpu()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, out, group=parallel_state.get_pipeline_model_parallel_group())
        out = {k: v for stage in stages for k, v in stage.items()}
    return out


def _whole(matrix: torch.Tensor, group) -> torch.Tensor:
    if not getattr(matrix, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return matrix.detach().clone()
    parts = [torch.empty_like(matrix) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, matrix.detach().contiguous(), group=group)
    return torch.cat(parts, matrix.partition_dim)


def adapter_config(section, targets: set[str], base_model: str) -> dict:
    """peft's LoraConfig as adapter_config.json holds it (`section`: actor.lora)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": section.rank, "lora_alpha": section.alpha, "lora_dropout": section.dropout,
            "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_peft(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """The PEFT directory at `directory` (written beside it under a temporary name, then renamed; an existing one
    is replaced). Returns the bytes of the adapter weights."""
    from safetensors.torch import save_file

    directory = Path(directory)
    staging = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_peft(engine, directory: str | Path, base_model: str) -> int:
    """The engine's adapters as a PEFT directory, written by global rank 0 (collective: every rank calls it).
    Returns the adapter weights' bytes on every rank."""
    tensors = adapter_tensors(engine)
    if dist.get_rank() == 0:
        write_peft(directory, tensors, adapter_config(engine.lora.section, engine.lora.targets, base_model))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_peft(directory: str | Path) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT LoRA directory: its config and (A, B) by the HF module's weight name (e.g.
    model.layers.0.self_attn.q_proj.weight)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    tensors = load_file(str(directory / WEIGHTS_FILE))
    pairs = {}
    for key, A in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
            pairs[f"{module}.weight"] = (A, tensors[key.replace(".lora_A.", ".lora_B.")])
    return config, pairs


def merged(weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """weight + scale * B A in the weight's dtype, the product and sum in float32 (the policy's export merges so:
    lora.AdaptedLinear.merged_weight)."""
    return (weight.float() + scale * (B.float() @ A.float())).to(weight.dtype)
