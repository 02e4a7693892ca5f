"""The transfer plan of one weight sync: which rows of each HF tensor move from which training rank to
which generation rank (megarl.reshard.inventory gives each tensor's TP row blocks, megarl.reshard.layout
who holds which).

- a training rank holds rows `spec.rows(TP_t, tp_rank)` of each dense tensor of its pipeline stage, and rows
  `spec.rows(ETP, etp_rank)` of each routed expert its EP rank owns there;
- a generation rank needs its rows of each tensor it holds in generation (`layout.needed`): only its TP shard
  ("sharded" delivery, HybridFlow's zero-redundancy idea) or all rows ("full": whole HF tensors that the
  engine slices itself, the reference path); with generation EP, only the routed experts of its EP slice;
- it receives exactly what it needs minus what it holds, each missing row block from a training rank of the
  owning stage that holds it: for dense tensors the one in the receiver's own DP replica, for routed experts
  the one of the owning EP rank in the receiver's own expert-DP replica (spreading the senders). Expert rows
  thus move only from ranks holding that expert to ranks needing it.
The same plan gives the planner's byte counts (`transfer_bytes`) and drives the transfers
(megarl.reshard.resharder).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megarl.reshard.inventory import TensorSpec
from megarl.reshard.layout import DELIVERIES, GenLayout, TrainLayout, as_generation, generation_ranks, needed


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of one tensor, sent by training rank `src` to generation rank `dst`."""
    src: int
    dst: int
    lo: int
    hi: int


def _minus(a: tuple[int, int], b: tuple[int, int] | None) -> list[tuple[int, int]]:
    if b is None or b[1] <= a[0] or a[1] <= b[0]:
        return [a] if a[1] > a[0] else []
    return [r for r in ((a[0], b[0]), (b[1], a[1])) if r[1] > r[0]]


def _sources(spec: TensorSpec, train: TrainLayout, dst: int) -> list[tuple[int, tuple[int, int]]]:
    """(training rank, rows it holds) of every TP (or ETP) block of `spec`, from the replica that serves `dst`."""
    stage = train.stage(spec)
    if spec.expert is None:
        _, dp_rank, _ = train.coords(dst)
        return [(train.rank(t, dp_rank, stage), spec.rows(train.tp, t)) for t in range(train.tp)]
    _, _, edp_rank, _ = train.expert_coords(dst)
    owner = train.expert_owner(spec)
    return [(train.expert_rank(t, owner, edp_rank, stage), spec.rows(train.etp, t)) for t in range(train.etp)]


def plan_tensor(spec: TensorSpec, train: TrainLayout, gen: int | GenLayout, delivery: str) -> list[Piece]:
    """Every transfer of one tensor, in the same order on every rank."""
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery={delivery!r}: expected one of {DELIVERIES}")
    gen = as_generation(gen)
    pieces = []
    for dst in range(train.world):
        need = needed(spec, gen, dst, delivery)
        if need is None:
            continue
        for lo, hi in _minus(need, train.held(spec, dst)):
            for src, (h_lo, h_hi) in _sources(spec, train, dst):
                if max(lo, h_lo) < min(hi, h_hi):
                    pieces.append(Piece(src, dst, max(lo, h_lo), min(hi, h_hi)))
    return pieces


@functools.lru_cache(maxsize=None)
def _tensor_bytes(spec: TensorSpec, train: TrainLayout, gen: GenLayout, delivery: str, itemsize: int):
    recv, sent = [0] * train.world, [0] * train.world
    for p in plan_tensor(spec, train, gen, delivery):
        nbytes = (p.hi - p.lo) * spec.row_numel * spec.itemsize(itemsize)
        recv[p.dst] += nbytes
        sent[p.src] += nbytes
    return recv, sent


def _stand_in(spec: TensorSpec, train: TrainLayout, gen: GenLayout) -> TensorSpec:
    """A tensor whose plan is `spec`'s: plans depend on the name only through the stage, and on a routed
    expert's index only through the training and generation EP ranks owning it; one stand-in (unnamed, in the
    stage's first layer, the first expert of that pair of owners) serves all alike (the thousands of experts
    of a MoE model)."""
    stand_in = dataclasses.replace(spec, name="", layer=train.first_layer(train.stage(spec)))
    if spec.expert is not None:
        first = max(train.expert_owner(spec) * (spec.experts // train.ep),
                    gen.expert_owner(spec) * (spec.experts // gen.ep))
        stand_in = dataclasses.replace(stand_in, expert=first)
    return stand_in


def transfer_bytes(specs: list[TensorSpec], train: TrainLayout, gen: int | GenLayout, delivery: str,
                   itemsize: int) -> tuple[list[int], list[int]]:
    """Bytes each rank receives and sends in one sync (the planner's numbers, and the resharder's); `gen` is the
    generation layout or a bare generation TP (no generation EP); `itemsize` the model's (fp32 tensors take 4)."""
    gen = as_generation(gen)
    generation_ranks(train, gen)
    recv, sent = [0] * train.world, [0] * train.world
    for spec in specs:
        r, s = _tensor_bytes(_stand_in(spec, train, gen), train, gen, delivery, itemsize)
        recv = [a + b for a, b in zip(recv, r)]
        sent = [a + b for a, b in zip(sent, s)]
    return recv, sent
