"""Training layout (TP_t, PP_t, DP_t) and generation layout (TP_g, DP_g) over the same ranks.

Every rank of the job is also a generation rank: generation TP group k is ranks [k*TP_g, (k+1)*TP_g),
i.e. a block of one training TP group (TP_g <= TP_t) or a run of whole training TP groups (TP_g a
multiple of TP_t), since megatron numbers ranks tp fastest, then dp, then pp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megarl.reshard.inventory import TensorSpec

DELIVERIES = ("full", "sharded")


@dataclass(frozen=True)
class TrainLayout:
    tp: int
    pp: int
    dp: int
    num_layers: int
    stage_layers: tuple[int, ...] = ()  # decoder layers per pipeline stage; () = num_layers / pp each

    def __post_init__(self):
        if not self.stage_layers:
            if self.num_layers % self.pp:
                raise ValueError(f"PP={self.pp} does not divide num_layers={self.num_layers}: give stage_layers")
            object.__setattr__(self, "stage_layers", (self.num_layers // self.pp,) * self.pp)
        if len(self.stage_layers) != self.pp or sum(self.stage_layers) != self.num_layers:
            raise ValueError(f"stage_layers={self.stage_layers} must be {self.pp} counts summing to {self.num_layers}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """megatron's order: tp fastest, then dp, then pp (no CP/EP)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def stage(self, spec: TensorSpec) -> int:
        if spec.layer is None:
            return 0 if "embed_tokens" in spec.name else self.pp - 1
        return self.layer_stage(spec.layer)

    def layer_stage(self, layer: int) -> int:
        end = 0
        for stage, count in enumerate(self.stage_layers):
            end += count
            if layer < end:
                return stage
        raise ValueError(f"layer {layer} is past the {self.num_layers} decoder layers")

    def first_layer(self, stage: int) -> int:
        return sum(self.stage_layers[:stage])

    def held(self, spec: TensorSpec, rank: int) -> tuple[int, int] | None:
        t, _, p = self.coords(rank)
        return spec.rows(self.tp, t) if p == self.stage(spec) else None


def generation_ranks(train: TrainLayout, gen_tp: int) -> list[list[int]]:
    """The generation TP groups, as blocks of the training TP groups or runs of whole ones."""
    if train.world % gen_tp or (train.tp % gen_tp and gen_tp % train.tp):
        raise ValueError(f"generation TP={gen_tp} must divide the world ({train.world}) and divide or be a "
                         f"multiple of training TP={train.tp}")
    return [list(range(k * gen_tp, (k + 1) * gen_tp)) for k in range(train.world // gen_tp)]


def new_generation_group(train: TrainLayout, gen_tp: int):
    """This rank's generation TP group (collective: every rank builds every group, as torch requires)."""
    mine = None
    for ranks in generation_ranks(train, gen_tp):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def needed(spec: TensorSpec, gen_tp: int, rank: int, delivery: str) -> tuple[int, int]:
    return (0, spec.length) if delivery == "full" else spec.rows(gen_tp, rank % gen_tp)
