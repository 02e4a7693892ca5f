"""Streams the policy of a megatron GPTModel into the generation layout, bucket by bucket, along the
transfer plan (megarl.reshard.transfers): point-to-point sends and receives, one batch per bucket.
Routed experts move from the ranks of their owning EP rank only, to the generation ranks holding them
(megarl.reshard.layout.GenLayout: all of them, or with generation EP those of the expert's EP slice).
Buckets are cut on every rank at the same tensors, from the largest per-rank cost of each tensor (its
delivered shard plus any staging copies), so extra memory on any rank stays within one bucket or one
tensor's cost. Tensors move in the model's dtype, those the inventory marks fp32 (DeepSeek-V3's routing bias,
which megatron keeps in float32 in a bf16 model) in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from megarl.reshard.inventory import TensorSpec, stacked_rows
from megarl.reshard.layout import GenLayout, TrainLayout, as_generation, generation_ranks, needed
from megarl.reshard.transfers import Piece, plan_tensor
from megarl.utils.bucketing import buckets_by_size


def _rows(t: torch.Tensor, dim: int | None, lo: int, hi: int) -> torch.Tensor:
    return t if dim is None else t.narrow(dim, lo, hi - lo)


@dataclass
class HeldRows:
    """Rows [lo, hi) of one HF tensor inside this rank's megatron shard: row lo + i sits at position
    index[i] along `dim` (a fused shard interleaves them: q/k/v per query group, padded vocab). `transposed`: the
    shard holds the 2-D HF tensor transposed (a stacked expert's input-major row: gpt-oss's, Qwen3-VL-MoE's), its
    rows along the other dimension."""
    shard: torch.Tensor
    dim: int | None
    index: torch.Tensor | None
    lo: int
    hi: int
    transposed: bool = False

    def take(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) in the HF tensor's orientation: a view where they sit side by side, else a copy."""
        if self.dim is None:
            return self.shard
        idx = self.index[a - self.lo:b - self.lo]
        dim = 1 - self.dim if self.transposed else self.dim
        # a view only where the rows are consecutive in order: a fused shard may permute rows between two ends that
        # look consecutive (Qwen3-Next's in_proj_qkvz, grouped per key head, in megatron's [q; k; v; z] order)
        start = int(idx[0]) if len(idx) else 0
        if torch.equal(idx.cpu(), torch.arange(start, start + len(idx))):
            rows = self.shard.narrow(dim, start, b - a)
        else:
            rows = self.shard.index_select(dim, idx.to(self.shard.device))
        return rows.t() if self.transposed else rows


class Resharder:
    """Streams the policy of a megatron GPTModel into the generation layout, bucket by bucket.

    `local` maps each HF tensor this rank holds rows of to its HeldRows (build it with `held_rows`).
    """

    def __init__(self, specs: list[TensorSpec], train: TrainLayout, local: dict[str, HeldRows], rank: int):
        self.specs, self.train, self.local, self.rank = specs, train, local, rank
        self._by_name = {s.name: s for s in specs}
        # bytes this rank received from and sent to other ranks in the last `buckets` run, counted from the tensors
        # that went on the wire (the planner's transfer_bytes must predict them)
        self.received_bytes = self.sent_bytes = 0

    def _cost(self, spec: TensorSpec, pieces: list[Piece], gen: GenLayout, delivery: str, itemsize: int) -> int:
        """An upper bound of the extra bytes any rank allocates for this tensor: its delivered rows, a
        copy of the rows it holds itself, copies of what it sends, staging of what it receives."""
        row = spec.row_numel * itemsize
        cost = []
        for r in range(self.train.world):
            need, held = needed(spec, gen, r, delivery), self.train.held(spec, r)
            if need is None:
                cost.append(0)
                continue
            lo, hi = need
            own = max(0, min(hi, held[1]) - max(lo, held[0])) if held else 0
            cost.append((hi - lo + own) * row)
        for p in pieces:
            cost[p.src] += (p.hi - p.lo) * row
            cost[p.dst] += (p.hi - p.lo) * row
        return max(cost)

    def buckets(self, gen: int | GenLayout, delivery: str, bucket_bytes: int,
                dtype: torch.dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Collective: every rank iterates to the end. Yields this rank's (HF name, tensor) per bucket:
        whole tensors ("full") or the rows of its generation shard ("sharded"), of every tensor it holds in the
        generation layout `gen` (a GenLayout, or a bare generation TP: no generation EP). `dtype`: the model's
        (its parameters'); fp32 tensors of the inventory come in float32."""
        gen = as_generation(gen)
        generation_ranks(self.train, gen)
        rows = stacked_rows(self.specs)
        if rows and delivery != "full":
            raise ValueError("the stacked experts' rows (gpt-oss, Qwen3-VL-MoE) move by full delivery only")
        self.received_bytes = self.sent_bytes = 0
        moved = (self._move(bucket, gen, delivery, dtype)
                 for bucket in buckets_by_size(self._planned(gen, delivery, dtype.itemsize), bucket_bytes))
        yield from _stacked(moved, rows) if rows else moved

    def _planned(self, gen: GenLayout, delivery: str, itemsize: int) -> Iterator[tuple[tuple[TensorSpec, list], int]]:
        """Each tensor's (spec, its pieces) with its cost (_cost), in the inventory's order."""
        for spec in self.specs:
            pieces = plan_tensor(spec, self.train, gen, delivery)
            yield (spec, pieces), self._cost(spec, pieces, gen, delivery, spec.itemsize(itemsize))

    def _move(self, bucket, gen: GenLayout, delivery: str, model_dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        ops, staged, out = [], [], []
        for spec, pieces in bucket:
            dtype = torch.float32 if spec.fp32 else model_dtype
            need = needed(spec, gen, self.rank, delivery)
            held = self.local.get(spec.name)
            for p in pieces:  # what this rank sends, whether or not it receives anything itself
                if p.src == self.rank:
                    # Gloo matches by (peer, tag), and alike messages in posting order: the plan order on both sides.
                    ops.append(dist.P2POp(dist.isend, held.take(p.lo, p.hi).contiguous(), p.dst, tag=p.lo))
            if need is None:  # a routed expert of another generation EP rank
                continue
            lo, hi = need
            if spec.parts and self.train.tp > 1 and (lo, hi) != (0, spec.length):
                raise ValueError(f"{spec.name}: its rows at training TP={self.train.tp} are in TP order (q, k and v "
                                 "each cut by heads); only a full delivery of it is put back in the HF order")
            if held is not None and held.lo <= lo and hi <= held.hi:
                rows = held.take(lo, hi)
                out.append((spec.name, rows if rows.is_contiguous() else rows.contiguous()))
                continue
            shape = list(spec.shape)
            if spec.dim is not None:
                shape[spec.dim] = hi - lo
            result = torch.empty(shape, dtype=dtype, device=held.shard.device if held else _device())
            if held is not None and max(lo, held.lo) < min(hi, held.hi):
                a, b = max(lo, held.lo), min(hi, held.hi)
                _rows(result, spec.dim, a - lo, b - lo).copy_(held.take(a, b))
            for p in pieces:
                if p.dst == self.rank:
                    target = _rows(result, spec.dim, p.lo - lo, p.hi - lo)
                    if not target.is_contiguous():
                        staged.append((target, torch.empty(target.shape, dtype=dtype, device=target.device)))
                        target = staged[-1][1]
                    ops.append(dist.P2POp(dist.irecv, target, p.src, tag=p.lo))
            out.append((spec.name, result))
        if ops:
            for op in ops:
                nbytes = op.tensor.numel() * op.tensor.element_size()
                if op.op is dist.isend:
                    self.sent_bytes += nbytes
                else:
                    self.received_bytes += nbytes
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for target, buffer in staged:
            target.copy_(buffer)
        return [(name, self._hf_order(name, tensor)) for name, tensor in out]

    def _hf_order(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A whole `parts` tensor (inventory.TensorSpec.parts) gathered in TP order, put in the HF order."""
        spec = self._by_name[name]
        if not spec.parts or self.train.tp == 1:
            return tensor
        hf = torch.empty_like(tensor)
        hf[spec.tp_order(self.train.tp).to(tensor.device)] = tensor
        return hf


def _stacked(buckets: Iterator[list], rows: dict[str, tuple[str, int, int]]) -> Iterator[list]:
    """The buckets with each stacked checkpoint tensor whole under its own name (inventory.stacked_rows) in place of
    its rows: it goes in the bucket that brings its last row (a layer's rows are listed together, so at most one
    layer's rows wait), copied out of the rows (some are views of this rank's parameters). Buckets left empty go."""
    waiting: dict[str, dict[int, torch.Tensor]] = {}
    for bucket in buckets:
        out = []
        for name, tensor in bucket:
            if name not in rows:
                out.append((name, tensor))
                continue
            stacked, row, count = rows[name]
            held = waiting.setdefault(stacked, {})
            held[row] = tensor
            if len(held) == count:
                out.append((stacked, torch.stack([held[e] for e in range(count)])))
                del waiting[stacked]
        if out:
            yield out


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def engine_resharder(engine, rank: int) -> Resharder:
    """The resharder of a MegatronEngine's policy on this rank, its layout from megatron's state: TP, PP with the
    layers each stage actually built (uneven first/last stages included), EP and ETP. Context-parallel ranks hold
    the same weights as data-parallel ones, and megatron numbers them between TP and DP (tp-cp-dp-pp): the
    resharder counts CP x DP replicas as its DP."""
    from megatron.core import parallel_state as mpu

    from megarl.reshard.inventory import hf_inventory
    from megarl.utils.hf_config import language_fields

    specs = hf_inventory(engine.hf_config)
    train = TrainLayout(mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                        mpu.get_data_parallel_world_size(with_context_parallel=True),
                        language_fields(engine.hf_config)["num_hidden_layers"], stage_layers=_stage_layers(engine.layout.layer_stage),
                        ep=mpu.get_expert_model_parallel_world_size(),
                        etp=mpu.get_expert_tensor_parallel_world_size())
    return Resharder(specs, train, held_rows(engine.gpts, engine.weight_maps, specs, train, rank), rank)


def _stage_layers(layer_stage: dict[int, int]) -> tuple[int, ...]:
    """Layers per pipeline stage from megatron's layer -> stage map; the resharder models contiguous stages
    only (virtual pipeline chunks interleave them)."""
    stages = [layer_stage[layer] for layer in sorted(layer_stage)]
    if stages != sorted(stages):
        raise ValueError("the resharder models contiguous pipeline stages; virtual pipeline stages interleave them")
    return tuple(stages.count(stage) for stage in range(max(stages) + 1)) if stages else ()


def held_rows(gpt, weight_maps, specs: list[TensorSpec], train: TrainLayout, rank: int) -> dict[str, HeldRows]:
    """For each HF tensor this rank's stage owns, where its rows sit in this rank's megatron shard.

    Found by running the family's own `to_shard` on row-index probes: tensors shaped like the HF ones
    but 1 wide outside the split dimension, holding 1 + (row id across the map's HF tensors); 0 marks
    padding. Routed experts are cut by expert TP (TrainLayout.etp), everything else by TP. The rows found must
    be the block the inventory (and so the planner) assumes.
    """
    from megarl.engine.weights import global_parameters

    params = global_parameters(gpt)
    by_name = {s.name: s for s in specs}
    local = {}
    for wm in weight_maps:
        if not wm.export or wm.megatron not in params:
            continue
        shard = params[wm.megatron].detach()
        # a stacked HF tensor (WeightMap.stacked): this parameter is its row, listed as `<name>.{row}`
        hf_specs = [by_name[n if wm.stacked is None else f"{n}.{wm.stacked[0]}"] for n in wm.hf]
        if all(s.dim is None for s in hf_specs):
            (spec,) = hf_specs
            local[spec.name] = HeldRows(shard, None, None, 0, 1)
            continue
        tp, tp_rank = (train.etp, train.expert_coords(rank)[0]) if hf_specs[0].expert is not None else \
            (train.tp, train.coords(rank)[0])
        # a whole tensor fused with split ones is probed by its rows: this rank must hold all of them, in order, and
        # passes them on as that block of its shard
        lengths = [s.length if s.dim is not None else s.shape[0] for s in hf_specs]
        probes, offset = [], 0
        for s, length in zip(hf_specs, lengths):
            shape = [1] * len(s.shape)
            shape[s.dim or 0] = length
            probes.append((torch.arange(length) + offset + 1).reshape(shape))
            offset += length
        ids = wm.to_shard(probes, tp_rank, tp)
        # one 2-D HF tensor whose probe comes back along the other dimension: the shard holds it transposed
        transposed = len(hf_specs) == 1 and ids.dim() == 2 and hf_specs[0].dim is not None and \
            ids.shape[hf_specs[0].dim] == 1 < ids.shape[1 - hf_specs[0].dim]
        ids = ids.reshape(-1)
        offset = 0
        for s, length in zip(hf_specs, lengths):
            positions = ((ids > offset) & (ids <= offset + length)).nonzero().reshape(-1)
            rows = ids[positions] - offset - 1
            if s.parts:  # HF rows -> the TP order the inventory counts them in
                rows = s.tp_order(tp).argsort()[rows]
            positions = positions[rows.argsort()]  # by row: a fused shard may reorder them (gated q_proj)
            lo, hi = s.rows(tp, tp_rank) if s.dim is not None else (0, length)
            if not torch.equal(rows.sort().values, torch.arange(lo, hi)):
                raise ValueError(f"{s.name}: TP rank {tp_rank} of {tp} does not hold the rows [{lo}, {hi}) "
                                 f"the inventory expects")
            if s.dim is None:
                local[s.name] = HeldRows(shard.narrow(0, int(positions[0]), length), None, None, 0, 1)
            else:
                local[s.name] = HeldRows(shard, s.dim, positions, lo, hi, transposed)
            offset += length
    return local
