"""The policy's LoRA adapters (megarl/engine/lora.py) as a PEFT adapter directory: adapter_config.json and
adapter_model.safetensors, what peft's PeftModel.from_pretrained and SGLang's /load_lora_adapter read.

Each HF projection's A [rank, in] and B [out, rank] whole (a TP-split matrix gathered along its split axis, the
pipeline stages' layers gathered), under peft's key for the projection's HF module:
base_model.model.<module>.lora_A.weight and .lora_B.weight (the module named by the family's weight map, e.g.
model.layers.0.self_attn.q_proj). adapter_config.json records the rank, alpha, dropout, the projections adapted and
the base model's path (base_model_name_or_path). peft's forward is W x + (alpha / r) B A x, the policy's.

A mixture-of-experts layer's routed experts are one module in transformers 5 (<layer>.mlp.experts, whatever the
checkpoint calls them), their weights fused 3-D parameters: gate_up_proj [experts, 2 x width, hidden] ([gate; up]
rows) and down_proj [experts, hidden, width]. peft adapts them through target_parameters (its ParamWrapper): one
A [R x experts, in] and one B [out, R x experts] per parameter, expert e's A the rows e x R + j and its B the columns
j x experts + e (j < R), each expert computing W_e x + (alpha_e / R) B_e A_e x. peft reads the checkpoint's
per-expert gate_proj and up_proj adapters (transformers 4's, and target_modules naming them) as one block-diagonal
adapter of gate_up_proj of rank R = 2 x r and alpha 2 x alpha (rank_pattern, alpha_pattern: the same scale):
A_e = [A_gate; A_up], B_e = [[B_gate, 0], [0, B_up]]; the policy's expert adapters are written so, gathered from the
EP ranks holding them. Where both parameters are adapted peft nests its wrappers, gate_up_proj's inside down_proj's:
its keys are <layer>.mlp.experts.base_layer.lora_A.weight, down_proj's <layer>.mlp.experts.lora_A.weight (one alone:
the latter), and target_parameters names them gate_up_proj and down_proj, as peft writes them. On such a model peft also reads gate_proj, up_proj and down_proj in target_modules as the experts', so
the linear MLP projections of its dense layers and shared experts are named by their weights in target_parameters
(mlp.shared_experts.gate_proj.weight; the same keys as target_modules gives, the same LoRA).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
EXPERTS = "mlp.experts"  # where transformers 5 holds a layer's routed experts, fused
_EXPERT_HF = re.compile(r"^(.*)\.[^.]+\.experts\.\d+\.[^.]+\.weight$")  # one expert's tensor in the checkpoint
_IN_LAYER = re.compile(r"^.*\.layers\.\d+\.")  # a layer's prefix in an HF name
MLP = ("gate_proj", "up_proj", "down_proj")


def adapter_tensors(engine) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Every adapter matrix whole, on the CPU, by its PEFT key; the same on every rank; with the projections adapted
    as linear modules (target_modules) and the parameters adapted (target_parameters). Collective over the TP, EP and
    pipeline groups: every rank calls it."""
    from megatron.core import parallel_state  # here: the rollout engines read and merge adapters without megatron

    from megarl.engine import weights

    lora = engine.lora
    moe = bool(engine.gpt.config.num_moe_experts)
    by_megatron = {wm.megatron: wm for wm in engine.weight_maps}
    out, modules, parameters = {}, set(), set()
    experts = {}  # (the layer's experts module, projection) -> {expert: (A, B)}
    for name, param in sorted(weights.global_parameters(engine.gpts).items()):
        layer = lora.layers.get(id(param))
        if layer is None:
            continue
        hf, expert = by_megatron[name].hf, weights.expert_index(name)
        for proj, adapter in layer.adapters.items():
            A, B = _whole(adapter.A, layer.group), _whole(adapter.B, layer.group)
            if expert is not None:
                match = _EXPERT_HF.match(hf[0])
                if match is None:
                    raise ValueError(f"{name}: the family's weight map names its expert {hf[0]}, not as "
                                     "<layer>.<block>.experts.<e>.<projection>.weight; its adapters have no PEFT name")
                experts.setdefault((f"{match.group(1)}.{EXPERTS}", proj), {})[expert] = (A, B)
                continue
            module = next((n.removesuffix(".weight") for n in hf if n.endswith(f".{proj}.weight")), None)
            if module is None:
                raise ValueError(f"{name}: the family's weight map names no {proj} among {list(hf)}; its adapters have "
                                 "no PEFT name")
            if moe and proj in MLP:  # peft would take the name for the experts': named by its weight
                parameters.add(_IN_LAYER.sub("", module) + ".weight")
            else:
                modules.add(proj)
            out[f"{PREFIX}{module}.lora_A.weight"], out[f"{PREFIX}{module}.lora_B.weight"] = A, B
    if experts and parallel_state.get_expert_model_parallel_world_size() > 1:
        ranks = [None] * parallel_state.get_expert_model_parallel_world_size()
        dist.all_gather_object(ranks, experts, group=parallel_state.get_expert_model_parallel_group())
        experts = {}
        for held in ranks:
            for key, by_expert in held.items():
                experts.setdefault(key, {}).update(by_expert)
    out |= _fused_experts(experts, engine.gpt.config.num_moe_experts, parameters)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, (out, modules, parameters),
                               group=parallel_state.get_pipeline_model_parallel_group())
        out = {k: v for stage, _, _ in stages for k, v in stage.items()}
        modules = {m for _, held, _ in stages for m in held}
        parameters = {p for _, _, held in stages for p in held}
    return out, sorted(modules), sorted(parameters)


def _fused_experts(experts: dict, count: int, parameters: set[str]) -> dict[str, torch.Tensor]:
    """peft's tensors of transformers' fused expert parameters from every expert's gate, up and down (A, B); the
    parameters adapted added to `parameters`."""
    out = {}
    for module in sorted({module for module, _ in experts}):
        fused = {}
        held = {proj: experts[module, proj] for proj in MLP if (module, proj) in experts}
        for proj, by_expert in held.items():
            if sorted(by_expert) != list(range(count)):
                raise ValueError(f"{module}.{proj}: adapters of experts {sorted(by_expert)} gathered, not all {count}")
        if "down_proj" in held:
            fused["down_proj"] = [held["down_proj"][e] for e in range(count)]
        if {"gate_proj", "up_proj"} <= set(held):  # block-diagonal: gate's rows take gate's rank, up's rows up's
            fused["gate_up_proj"] = [(torch.cat([held["gate_proj"][e][0], held["up_proj"][e][0]]),
                                      torch.block_diag(held["gate_proj"][e][1], held["up_proj"][e][1]))
                                     for e in range(count)]
        elif {"gate_proj", "up_proj"} & set(held):
            raise ValueError(f"{module}: gate_proj and up_proj are one fused parameter in transformers: adapt both")
        for parameter, pairs in fused.items():
            As, Bs = zip(*pairs)
            B = torch.stack(Bs, 2)  # [out, R, experts]: expert e's column j at j x experts + e
            # peft wraps gate_up_proj inside down_proj where both are adapted
            nested = f"{module}.base_layer" if parameter == "gate_up_proj" and len(fused) == 2 else module
            out[f"{PREFIX}{nested}.lora_A.weight"] = torch.cat(As, 0)
            out[f"{PREFIX}{nested}.lora_B.weight"] = B.reshape(B.shape[0], -1)
            parameters.add(parameter)  # as peft names it: the parameter's own name
    return out


def _whole(matrix: torch.Tensor, group) -> torch.Tensor:
    if not getattr(matrix, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return matrix.detach().clone().cpu()
    parts = [torch.empty_like(matrix) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, matrix.detach().contiguous(), group=group)
    return torch.cat(parts, matrix.partition_dim).cpu()


def adapter_config(section, modules: list[str], parameters: list[str], base_model: str) -> dict:
    """peft's LoraConfig as adapter_config.json holds it (`section`: actor.lora; `modules`: the projections adapted
    as linear modules, `parameters`: those named by their weights, the experts' fused ones among them)."""
    fused = {r".*\.gate_up_proj": 2} if "gate_up_proj" in parameters else {}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": section.rank, "lora_alpha": section.alpha, "lora_dropout": section.dropout,
            "target_modules": modules, "target_parameters": parameters or None, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
            "rank_pattern": {k: n * section.rank for k, n in fused.items()},
            "alpha_pattern": {k: n * section.alpha for k, n in fused.items()}}


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
    tensors, modules, parameters = adapter_tensors(engine)
    if dist.get_rank() == 0:
        write_peft(directory, tensors, adapter_config(engine.lora.section, modules, parameters, base_model))
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
