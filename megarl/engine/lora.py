"""LoRA on the policy (actor.lora): low-rank adapters on megatron-core's tensor-parallel linear layers, the base frozen.

An adapted projection computes W x + (alpha / rank) B A dropout(x), with A [rank, in] and B [out, rank] per HF
projection (peft's LoRA on q_proj, k_proj, ... of the same checkpoint, exactly). Megatron fuses projections: q, k and
v share linear_qkv, whose rows are grouped per query group (each group's query rows, then its key rows, then its
value rows: megarl/models/sharding.py fused_qkv), and gate and up share linear_fc1 ([this rank's gate rows; its up
rows]: fused_gate_up). Each projection keeps its own A and B; their product goes to its block of the fused rows.

Tensor parallelism as the base layer's:
- column-parallel (linear_qkv, linear_fc1): A whole on every rank, B split by output rows (the HF projection's rows
  in TP chunks, which are the rank's query groups or its gate/up rows). A x is the same on every rank; its gradient
  is summed over TP (copy_to_tensor_model_parallel_region), so A's gradient is whole and equal on every rank. Under
  sequence parallelism the input is gathered first (its gradient split back, not summed: every rank's is whole).
- row-parallel (linear_proj, linear_fc2): A split by input columns, B whole. The partial A x are summed over TP
  (reduce_from_tensor_model_parallel_region) before B, so B's output and gradient are whole on every rank; under
  sequence parallelism each rank keeps its own tokens of it, as the base's reduce-scatter does.

Mixture-of-experts layers: each routed expert of megatron's SequentialMLP (the experts megarl's MoE families build)
has its own gate, up and down adapters, as a dense MLP's, held by the EP rank that holds the expert (peft's LoRA on
transformers 5's fused experts, where gate and up become one block-diagonal adapter of rank 2 x rank: lora_peft.py).
The expert's layers run megatron's explicit expert communication (EP > 1 or expert-TP > 1): the dispatcher gathers
the tokens over the expert-TP group and its combine sums the ranks' partial outputs, so an adapter neither gathers
nor reduces activations; the matrix whole on every expert-TP rank (A of gate and up, B of down) has its gradient
summed over that group instead, from the rank's partial one. Shared experts and the dense MLP layers of a MoE model
are plain MLPs. Expert adapters are in DDP's expert buffers (allreduce False), as their base weights are.

Only the adapters have requires_grad: megatron's DDP and optimizer hold no gradient buffer, main copy or Adam state
of the base. The KL reference policy is the same model with the adapters off (disabled()). The rollout engine gets
the merged weights W + scale B A, in W's layout and dtype (merged_weight, through the engine's export). Checkpoints
hold the adapters alone (sharded_state_dict below; megarl/engine/checkpoint.py), the base reloads from model.path.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                                           get_cuda_rng_tracker,
                                           reduce_from_tensor_model_parallel_region,
                                           scatter_to_sequence_parallel_region, set_tensor_model_parallel_attributes)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from megarl.config.validation import lora_targets

KEY = "actor.lora.target_modules"
ATTENTION_QKV, ATTENTION_OUT = ("q_proj", "k_proj", "v_proj"), ("o_proj",)
MLP_IN, MLP_OUT = ("gate_proj", "up_proj"), ("down_proj",)


class Adapter(nn.Module):
    """One HF projection's A [rank, in] and B [out, rank] as this TP rank holds them."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, dropout: float):
        super().__init__()
        self.A, self.B = nn.Parameter(A), nn.Parameter(B)
        self.dropout = nn.Dropout(dropout)


class AdaptedLinear(nn.Module):
    """The adapters of one megatron linear layer (its child `lora`). Column-parallel: the layer's local output rows
    are `groups` repeats of `blocks` ((projection, rows) each, in order); row-parallel: one block, its input split.
    The layer's own TP group (the expert-TP group for an expert) and its communication settings are followed."""

    def __init__(self, owner: "Lora", linear, column: bool, groups: int, blocks: list[tuple[str, int]],
                 adapters: dict[str, Adapter]):
        super().__init__()
        self.owner, self.column, self.groups, self.blocks = owner, column, groups, blocks
        self.adapters = nn.ModuleDict(adapters)
        self.group = linear.tp_group
        # an expert's layer: the MoE dispatcher gathers its tokens and its combine sums the partial outputs
        self.explicit = bool(getattr(linear, "explicit_expert_comm", False))
        self.sequence_parallel = bool(linear.sequence_parallel) and not self.explicit

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A dropout(x) in the layer's local output layout (x: the layer's input, [s, b, in] or, an
        expert's, [tokens, in])."""
        group, sp, explicit = self.group, self.sequence_parallel, self.explicit
        if self.column:
            if sp:  # the base gathers the tokens of the TP group; the gradient of the gathered copy is whole per rank
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
            parts = []
            for name, rows in self.blocks:
                if name in self.adapters:
                    a = self.adapters[name]
                    # A is whole on every TP rank: the same mask on each, from the default RNG, which megatron keeps
                    # in step across TP ranks (its dropout on replicated activations relies on it too). An expert's
                    # input gradient is a partial sum (its dispatcher sums it): A's gradient is summed instead
                    h = (x @ copy_to_tensor_model_parallel_region(a.A, group=group).t() if explicit else
                         copy_to_tensor_model_parallel_region(a.dropout(x) @ a.A.t(), group=group))
                    parts.append((h @ a.B.t()).unflatten(-1, (self.groups, rows)))
                else:
                    parts.append(x.new_zeros(*x.shape[:-1], self.groups, rows))
            out = torch.cat(parts, -1).flatten(-2)
        else:
            a = self.adapters[self.blocks[0][0]]
            # this rank's input columns: a mask of their own, from megatron's per-TP-rank RNG stream (as its attention
            # dropout on split heads)
            with get_cuda_rng_tracker().fork() if a.dropout.p else contextlib.nullcontext():
                x = a.dropout(x)
            if explicit:  # the output is a partial sum (the combine sums it): B A x = the sum of B (A_rank x_rank)
                return (x @ a.A.t()) @ copy_to_tensor_model_parallel_region(a.B, group=group).t() * self.owner.scale
            h = reduce_from_tensor_model_parallel_region(x @ a.A.t(), group=group)
            out = h @ a.B.t()
            if sp:  # the base's output holds this rank's tokens (reduce-scatter); the gradient is all-gathered
                out = scatter_to_sequence_parallel_region(out, group=group)
        return out * self.owner.scale

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """weight + scale * B A in the weight's local layout and dtype (the product in float32)."""
        if self.column:
            parts = []
            for name, rows in self.blocks:
                if name in self.adapters:
                    a = self.adapters[name]
                    parts.append((a.B.float() @ a.A.float()).unflatten(0, (self.groups, rows)))
                else:
                    parts.append(weight.new_zeros(self.groups, rows, weight.shape[1], dtype=torch.float32))
            delta = torch.cat(parts, 1).flatten(0, 1)
        else:
            a = self.adapters[self.blocks[0][0]]
            delta = a.B.float() @ a.A.float()
        return (weight.float() + self.owner.scale * delta).to(weight.dtype)


class Lora:
    """The adapters installed on a model's chunks (install)."""

    def __init__(self, section):
        self.section, self.scale = section, section.alpha / section.rank
        self.enabled = True
        self.layers: dict[int, AdaptedLinear] = {}  # by id() of the base layer's weight

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers.values() for p in layer.parameters()]

    @contextlib.contextmanager
    def disabled(self):
        """The base model: the KL reference policy."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """What this rank exports for a parameter: an adapted weight merged with its adapters, others as they are."""
        layer = self.layers.get(id(param))
        return param if layer is None else layer.merged_weight(param)

    def describe(self) -> dict:
        """What a checkpoint of the adapters must match to load (engine.json)."""
        return {"rank": self.section.rank, "alpha": self.section.alpha, "targets": sorted(self.targets)}

    @property
    def targets(self) -> set[str]:
        return lora_targets(self.section)


def install(gpts, section, seed: int) -> Lora:
    """Adapters on every decoder layer's targeted projections of the chunks `gpts` (attention, dense MLP, shared
    experts, this rank's routed experts); every other parameter frozen. Before megatron's DDP and optimizer are built
    (they take the parameters that need gradients)."""
    config = gpts[0].config
    lora = Lora(section)
    targets = lora.targets
    qkv, mlp_in = [n for n in ATTENTION_QKV if n in targets], [n for n in MLP_IN if n in targets]
    mlp_targets = bool(mlp_in) or "down_proj" in targets
    for gpt in gpts:
        gpt.requires_grad_(False)
        for layer in getattr(getattr(gpt, "decoder", None), "layers", []):
            index = layer.layer_number - 1
            attention, where = layer.self_attention, f"decoder layer {index}"
            if qkv:
                _adapt(lora, getattr(attention, "linear_qkv", None), True, qkv, lambda w: _qkv_blocks(config),
                       str(index), where, seed)
            if "o_proj" in targets:
                _adapt(lora, getattr(attention, "linear_proj", None), False, ["o_proj"], _one("o_proj"), str(index),
                       where, seed)
            for key, where, mlp in _mlps(layer.mlp, index) if mlp_targets else ():
                if mlp_in:
                    _adapt(lora, getattr(mlp, "linear_fc1", None), True, mlp_in, partial(_gate_up_blocks, config),
                           key, where, seed)
                if "down_proj" in targets:
                    _adapt(lora, getattr(mlp, "linear_fc2", None), False, ["down_proj"], _one("down_proj"), key,
                           where, seed)
    if not lora.layers:
        raise ValueError(f"{KEY}={section.target_modules}: no layer of this model has those projections")
    return lora


def _mlps(mlp, index: int):
    """(seed key, description, module) of each MLP a decoder layer's `mlp` holds on this rank: the layer's dense MLP,
    or a MoE layer's shared experts and this EP rank's routed experts (by global index)."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        yield str(index), f"decoder layer {index}", mlp
        return
    if type(experts) is not SequentialMLP:  # grouped-GEMM experts (no linear per expert), gpt-oss's (biases, clamps)
        raise ValueError(f"{KEY}: gate_proj, up_proj and down_proj name the routed experts of decoder layer {index}, "
                         f"which are {type(experts).__name__} here; LoRA adapts megatron's SequentialMLP experts only: "
                         "target the attention projections alone (q_proj,k_proj,v_proj,o_proj)")
    if getattr(mlp, "shared_experts", None) is not None:
        yield f"{index}.shared_experts", f"the shared experts of decoder layer {index}", mlp.shared_experts
    for local, expert in enumerate(experts.local_experts):
        e = mlp.local_expert_indices[local]
        yield f"{index}.experts.{e}", f"expert {e} of decoder layer {index}", expert


def _one(name: str):
    return lambda weight: (1, [(name, weight.shape[0])])


def _qkv_blocks(config) -> tuple[int, list[tuple[str, int]]]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    head_dim, groups = config.kv_channels, config.num_query_groups or config.num_attention_heads
    per_group = config.num_attention_heads // groups
    return groups // tp, [("q_proj", per_group * head_dim), ("k_proj", head_dim), ("v_proj", head_dim)]


def _gate_up_blocks(config, weight) -> tuple[int, list[tuple[str, int]]] | None:
    """A gated MLP's linear_fc1: [this rank's gate rows; its up rows]."""
    if not config.gated_linear_unit:
        return None
    rows = weight.shape[0] // 2
    return 1, [("gate_proj", rows), ("up_proj", rows)]


def _adapt(lora: Lora, linear, column: bool, wanted: list[str], layout, key: str, where: str, seed: int) -> None:
    """Adapters for the projections `wanted` of one megatron layer `linear` (in `where`); `layout(weight)`: its local
    (groups, blocks), None where the layer is not a fused layout LoRA adapts; `key` names the layer in the seeds."""
    where = f"{KEY}: {', '.join(wanted)} in {where}"
    expected = ColumnParallelLinear if column else RowParallelLinear
    if not isinstance(linear, expected):
        raise ValueError(f"{where}: this model's layer has no megatron {expected.__name__} there "
                         f"({type(linear).__name__}; MLA attention and gated-delta-net layers take no adapters yet)")
    weight = linear.weight
    expert = not getattr(weight, "allreduce", True)  # an expert's weight, in DDP's expert buffers
    if expert and lora.section.dropout:
        raise ValueError(f"{where}: actor.lora.dropout={lora.section.dropout} on an expert: peft's LoRA on transformers' "
                         "fused experts has no dropout (no PEFT directory could hold the run); set actor.lora.dropout=0")
    groups_blocks = layout(weight)
    if column:
        if groups_blocks is None or linear.gather_output:
            raise ValueError(f"{where}: the layer is not the fused layout LoRA adapts (a gated MLP's gate and up rows)")
        groups, blocks = groups_blocks
        if groups * sum(rows for _, rows in blocks) != weight.shape[0]:
            raise ValueError(f"{where}: the layer's {weight.shape[0]} local rows are not the fused q/k/v or gate/up "
                             f"layout ({groups} x {blocks}); this family's fused rows take no adapters yet")
    else:
        groups, blocks = groups_blocks
    tp, rank = linear.tp_group.size(), linear.tp_group.rank()
    in_full = weight.shape[1] * (1 if column else tp)
    adapters = {}
    for name, rows in blocks:
        if name not in wanted:
            continue
        # A as peft initializes it (kaiming-uniform, a=sqrt(5)), the same on every rank from the layer's own seed;
        # B zero: the adapted policy starts as the base
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{key}.{name}".encode()))
        A = torch.empty(lora.section.rank, in_full)
        bound = 1 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
        A.uniform_(-bound, bound, generator=generator)
        if not column:
            A = A.chunk(tp, 1)[rank]
        A = A.to(weight.dtype).to(weight.device)
        B = torch.zeros(groups * rows if column else rows, lora.section.rank, dtype=weight.dtype, device=weight.device)
        adapter = Adapter(A.contiguous(), B, lora.section.dropout)
        split = adapter.B if column else adapter.A
        set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        if expert:
            for param in adapter.parameters():
                param.allreduce = False
        adapters[name] = adapter
    layer = AdaptedLinear(lora, linear, column, groups, blocks, adapters)
    linear.lora = layer
    linear.register_forward_hook(partial(_forward_hook, lora), with_kwargs=True)
    axis = {f"lora.adapters.{n}.{'B' if column else 'A'}": 0 if column else 1 for n in adapters}
    linear.sharded_state_dict = partial(_sharded_state_dict, linear, ({"weight": 0, "bias": 0} if column
                                                                      else {"weight": 1}) | axis)
    lora.layers[id(weight)] = layer


def _forward_hook(lora: Lora, linear, args, kwargs, output):
    if not lora.enabled:
        return output
    out, bias = output
    x = args[0] if args else kwargs["input_"]
    return out + linear.lora.delta(x).to(out.dtype), bias


def _sharded_state_dict(linear, axis: dict[str, int], prefix: str = "", sharded_offsets=(), metadata=None):
    """megatron's sharded state of the layer, its adapters' split matrices sharded along their split axis too (the
    layer's own method would write them as replicated: rank 0's shard alone)."""
    state = linear.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, tp_group=linear.tp_group,
                                               dp_cp_group=metadata["dp_cp_group"])
