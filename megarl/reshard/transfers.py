"""The transfer plan of one weight sync: which rows of each HF tensor move from which training rank to
which generation rank (megarl.reshard.inventory gives each tensor's TP row blocks).

- a training rank holds rows `spec.rows(TP_t, tp_rank)` of each tensor of its pipeline stage;
- a generation rank needs rows `spec.rows(TP_g, gen_tp_rank)` ("sharded" delivery: only its TP
  shard, HybridFlow's zero-redundancy idea) or all rows ("full" delivery: whole HF tensors that
  the engine slices itself, the reference path);
- it receives exactly what it needs minus what it holds, each missing row block from the training
  rank of the owning stage that holds it, in the receiver's own DP replica (spreading the senders).
The same plan gives the planner's byte counts (`transfer_bytes`) and drives the transfers
(megarl.reshard.resharder).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megarl.reshard.inventory import TensorSpec
from megarl.reshard.layout import DELIVERIES, TrainLayout, generation_ranks, needed


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


def plan_tensor(spec: TensorSpec, train: TrainLayout, gen_tp: int, delivery: str) -> list[Piece]:
    """Every transfer of one tensor, in the same order on every rank."""
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery={delivery!r}: expected one of {DELIVERIES}")
    stage = train.stage(spec)
    pieces = []
    for dst in range(train.world):
        _, dp_rank, _ = train.coords(dst)
        for lo, hi in _minus(needed(spec, gen_tp, dst, delivery), train.held(spec, dst)):
            for t in range(train.tp):
                h_lo, h_hi = spec.rows(train.tp, t)
                if max(lo, h_lo) < min(hi, h_hi):
                    pieces.append(Piece(train.rank(t, dp_rank, stage), dst, max(lo, h_lo), min(hi, h_hi)))
    return pieces


@functools.lru_cache(maxsize=None)
def _tensor_bytes(spec: TensorSpec, train: TrainLayout, gen_tp: int, delivery: str, itemsize: int):
    recv, sent = [0] * train.world, [0] * train.world
    for p in plan_tensor(spec, train, gen_tp, delivery):
        nbytes = (p.hi - p.lo) * spec.row_numel * itemsize
        recv[p.dst] += nbytes
        sent[p.src] += nbytes
    return recv, sent


def transfer_bytes(specs: list[TensorSpec], train: TrainLayout, gen_tp: int, delivery: str,
                   itemsize: int) -> tuple[list[int], list[int]]:
    """Bytes each rank receives and sends in one sync (the planner's numbers, and the resharder's)."""
    generation_ranks(train, gen_tp)
    recv, sent = [0] * train.world, [0] * train.world
    for spec in specs:
        # A tensor's plan depends on its name only through its stage: plan one unnamed stand-in in
        # the stage's first layer for all alike (the thousands of experts of a MoE model).
        stand_in = dataclasses.replace(spec, name="", layer=train.first_layer(train.stage(spec)))
        r, s = _tensor_bytes(stand_in, train, gen_tp, delivery, itemsize)
        recv = [a + b for a, b in zip(recv, r)]
        sent = [a + b for a, b in zip(sent, s)]
    return recv, sent
