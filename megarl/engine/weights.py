"""HF checkpoint <-> megatron GPTModel parameters, across TP and PP ranks.

Loading: each rank reads from the safetensors files only the HF tensors its own parameters are made
of, and cuts its TP shard (models/sharding.py). Exporting is collective: TP shards are all-gathered
within the owning pipeline stage, converted back to HF tensors there, and broadcast to the other
stages, so every rank yields the same buckets of full HF-named tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl.models.hf_checkpoint import SafetensorsCheckpoint  # the read path: FP8 dequant, MTP layers left out
from megarl.models.sharding import WeightMap
from megarl.utils.bucketing import buckets_by_size

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return json.loads(path.read_text())


def global_parameters(gpt) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters of a GPTModel, named with GLOBAL layer and expert indices (PP stages hold
    a slice of the layers, numbered from 0 locally; layer_number is megatron's 1-based global index;
    EP ranks hold a slice of each MoE layer's experts, local_expert_indices are their global indices).
    A list of virtual-pipeline chunks gives the union of its chunks' parameters."""
    if isinstance(gpt, (list, tuple)):
        return {name: p for chunk in gpt for name, p in global_parameters(chunk).items()}
    layers = gpt.decoder.layers if hasattr(gpt, "decoder") else []
    params = {}
    for name, param in gpt.named_parameters():
        match = _LAYER.match(name)
        if match:
            layer = layers[int(match.group(1))]
            rest = _EXPERT.sub(lambda e: f".mlp.experts.local_experts.{_global_expert(layer, e)}.",
                               "." + name[match.end():])
            name = f"decoder.layers.{layer.layer_number - 1}" + rest
        params[name] = param
    return params


def _global_expert(layer, local_match: re.Match) -> int:
    return layer.mlp.local_expert_indices[int(local_match.group(1))]


def expert_index(megatron_name: str) -> int | None:
    """The global index of the routed expert a parameter (named by global_parameters) belongs to; None for others."""
    match = _EXPERT.search(megatron_name)
    return None if match is None else int(match.group(1))


def _expert_owner(megatron_name: str, num_experts: int | None) -> int | None:
    """The EP rank holding an expert parameter (named by global expert index); None for the others."""
    expert = expert_index(megatron_name)
    if expert is None:
        return None
    return expert // (num_experts // parallel_state.get_expert_model_parallel_world_size())


def tp_group_of(megatron_name: str):
    """Experts are sharded over megatron's expert-TP group, everything else over the TP group."""
    if _EXPERT.search(megatron_name):
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def load_hf_weights(gpt, maps: list[WeightMap], checkpoint: SafetensorsCheckpoint) -> None:
    by_name = {m.megatron: m for m in maps}
    params = global_parameters(gpt)
    unmapped = sorted(set(params) - set(by_name))
    if unmapped:
        raise KeyError(f"no HF weight mapping for megatron parameters {unmapped}")
    with torch.no_grad():
        for name, param in params.items():
            wm = by_name[name]
            group = tp_group_of(name)
            hf = [checkpoint.read(n) if wm.stacked is None else checkpoint.read(n, wm.stacked[0]) for n in wm.hf]
            shard = wm.to_shard(hf, dist.get_rank(group), dist.get_world_size(group))
            if shard.shape != param.shape:
                raise ValueError(f"{name}: shard from {wm.hf} has shape {tuple(shard.shape)}, "
                                 f"the megatron parameter {tuple(param.shape)}")
            param.copy_(shard)


class PipelineLayout:
    """Which pipeline stage owns each megatron parameter (collective to build: all_gather over PP)."""

    def __init__(self, gpt):
        """gpt: this rank's GPTModel, or its list of virtual-pipeline chunks."""
        group = parallel_state.get_pipeline_model_parallel_group()
        chunks = gpt if isinstance(gpt, (list, tuple)) else [gpt]
        layers = [layer.layer_number - 1 for chunk in chunks
                  for layer in getattr(getattr(chunk, "decoder", None), "layers", [])]
        per_stage: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_stage, layers, group=group)
        self.layer_stage = {layer: stage for stage, stage_layers in enumerate(per_stage) for layer in stage_layers}
        self.ranks = dist.get_process_group_ranks(group)  # global rank of each stage, in stage order
        self.group = group

    def stage_of(self, megatron_name: str) -> int:
        match = _LAYER.match(megatron_name)
        if match:
            return self.layer_stage[int(match.group(1))]
        return 0 if megatron_name.startswith(("embedding.", "visual.")) else len(self.ranks) - 1


def export_hf_weights(gpt, maps: list[WeightMap], layout: PipelineLayout, hf_tensors: dict[str, tuple],
                      device: torch.device, bucket_bytes: int,
                      local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[list]:
    """Collective over the whole job: every rank must consume the iterator to the end. `hf_tensors`: each HF
    tensor's (shape, dtype) as its owners produce it (checkpoint.hf_tensors_from_model), what the other ranks
    receive it into. `local(parameter)`: the shard this rank exports for a parameter (LoRA's merged weight); by
    default the parameter."""
    sized = (((name, t), t.numel() * t.element_size())
             for name, t in _gathered(gpt, maps, layout, hf_tensors, device, local))
    return buckets_by_size(sized, bucket_bytes)


def _gathered(gpt, maps: list[WeightMap], layout: PipelineLayout, hf_tensors: dict[str, tuple],
              device: torch.device, local=None) -> Iterator[tuple[str, torch.Tensor]]:
    """export_hf_weights' full HF tensors one by one, on every rank."""
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    ep_group = parallel_state.get_expert_model_parallel_group()
    my_ep_rank = parallel_state.get_expert_model_parallel_rank()
    num_experts = (gpt[0] if isinstance(gpt, (list, tuple)) else gpt).config.num_moe_experts
    params = global_parameters(gpt)
    rows: dict[str, list] = {}  # stacked HF tensors (WeightMap.stacked): the rows so far, yielded once complete
    for wm in maps:
        if not wm.export:
            continue
        stage = layout.stage_of(wm.megatron)
        owner = _expert_owner(wm.megatron, num_experts)
        if stage == my_stage and owner in (None, my_ep_rank):
            tp_group = tp_group_of(wm.megatron)
            param = params[wm.megatron]
            shard = (param if local is None else local(param)).detach().contiguous()
            shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(shards, shard, group=tp_group)
            tensors = [t.contiguous() for t in wm.from_shards(shards)]
        else:
            row_shape = slice(None if wm.stacked is None else 1, None)
            tensors = [torch.empty(hf_tensors[n][0][row_shape], dtype=hf_tensors[n][1], device=device) for n in wm.hf]
        if owner is not None and stage == my_stage and dist.get_world_size(ep_group) > 1:
            for t in tensors:  # from the EP rank holding the expert to the rest of the stage
                dist.broadcast(t, src=dist.get_global_rank(ep_group, owner), group=ep_group)
        if len(layout.ranks) > 1:
            for t in tensors:
                dist.broadcast(t, src=layout.ranks[stage], group=layout.group)
        if wm.stacked is None:
            yield from zip(wm.hf, tensors)
            continue
        row, count = wm.stacked
        for name, t in zip(wm.hf, tensors):
            rows.setdefault(name, [None] * count)[row] = t
            if all(r is not None for r in rows[name]):
                yield name, torch.stack(rows.pop(name))
