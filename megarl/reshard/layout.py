"""Training layout (TP, PP, DP with EP and ETP for experts) and generation layout (TP, EP) over the same ranks.

Training: megatron numbers the ranks of dense tensors tp-cp-dp-pp (tp fastest; CP ranks hold the same
weights as DP ones, so `dp` counts CP x DP replicas) and those of routed experts tp-ep-dp-pp with tp = ETP
and dp = the expert-DP size world / (ETP x EP x PP) (megatron-core's RankGenerator; pipeline stages are the
same in both). An EP rank holds a contiguous block of num_experts / EP experts of each MoE layer, each cut
into ETP row blocks.

Generation (SGLang): generation TP group k is ranks [k*TP_g, (k+1)*TP_g), i.e. a block of one training TP
group (TP_g <= TP_t) or a run of whole training TP groups (TP_g a multiple of TP_t). With --ep-size EP_g,
SGLang splits each group's ranks moe_tp-fastest (moe_tp = TP_g / EP_g): generation TP rank t is MoE EP rank
t // moe_tp, holding the contiguous block of num_experts / EP_g experts of that EP rank, each cut into moe_tp
row blocks (moe TP rank t % moe_tp); with EP_g = 1 every rank holds its TP_g rows of every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megarl.config.sglang_args import sglang_ep_size
from megarl.reshard.inventory import TensorSpec, on_first_stage

DELIVERIES = ("full", "sharded")


def _expert_block(spec: TensorSpec, ep: int) -> int:
    """The EP rank (of `ep`) whose contiguous block of experts holds this routed expert."""
    if spec.experts % ep:
        raise ValueError(f"{spec.name}: EP={ep} does not divide its layer's {spec.experts} routed experts")
    return spec.expert // (spec.experts // ep)


@dataclass(frozen=True)
class TrainLayout:
    tp: int
    pp: int
    dp: int
    num_layers: int
    stage_layers: tuple[int, ...] = ()  # decoder layers per pipeline stage; () = num_layers / pp each
    ep: int = 1  # expert-parallel size: routed experts split over this many ranks of a stage
    etp: int | None = None  # expert-tensor-parallel size (each expert's TP); None = tp, megatron's default

    def __post_init__(self):
        if not self.stage_layers:
            if self.num_layers % self.pp:
                raise ValueError(f"PP={self.pp} does not divide num_layers={self.num_layers}: give stage_layers")
            object.__setattr__(self, "stage_layers", (self.num_layers // self.pp,) * self.pp)
        if len(self.stage_layers) != self.pp or sum(self.stage_layers) != self.num_layers:
            raise ValueError(f"stage_layers={self.stage_layers} must be {self.pp} counts summing to {self.num_layers}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.ep < 1 or self.etp < 1 or self.world % (self.etp * self.ep * self.pp):
            raise ValueError(f"ETP={self.etp} x EP={self.ep} x PP={self.pp} must divide the world "
                             f"(TP={self.tp} x DP={self.dp} x PP={self.pp} = {self.world} ranks)")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard within a stage (megatron's expert data-parallel size)."""
        return self.world // (self.etp * self.ep * self.pp)

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """megatron's order of dense ranks: tp fastest, then dp (CP x DP), then pp."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def expert_rank(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        """megatron's order of expert ranks: etp fastest, then ep, then expert dp, then pp."""
        return etp_rank + self.etp * (ep_rank + self.ep * (edp_rank + self.expert_dp * pp_rank))

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(etp_rank, ep_rank, expert dp_rank, pp_rank) of a global rank."""
        return (rank % self.etp, (rank // self.etp) % self.ep, (rank // (self.etp * self.ep)) % self.expert_dp,
                rank // (self.etp * self.ep * self.expert_dp))

    def expert_owner(self, spec: TensorSpec) -> int:
        """The EP rank holding a routed expert's tensor."""
        return _expert_block(spec, self.ep)

    def stage(self, spec: TensorSpec) -> int:
        if spec.layer is None:
            return 0 if on_first_stage(spec) else self.pp - 1
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
        """Rows of `spec` this rank holds: its TP block of a tensor of its stage, its ETP block of a routed
        expert its EP rank owns; None for anything else."""
        if spec.expert is not None:
            t, e, _, p = self.expert_coords(rank)
            if p != self.stage(spec) or e != self.expert_owner(spec):
                return None
            return spec.rows(self.etp, t)
        t, _, p = self.coords(rank)
        return spec.rows(self.tp, t) if p == self.stage(spec) else None


@dataclass(frozen=True)
class GenLayout:
    """The generation layout: TP_g ranks per engine, routed experts over EP_g of them (SGLang's --tp-size and
    --ep-size; module docstring)."""
    tp: int
    ep: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.ep < 1 or self.tp % self.ep:
            raise ValueError(f"generation EP={self.ep} must divide generation TP={self.tp} (SGLang's --ep-size "
                             f"divides --tp-size)")

    @property
    def moe_tp(self) -> int:
        """Each expert's TP within the generation engine."""
        return self.tp // self.ep

    def expert_owner(self, spec: TensorSpec) -> int:
        """The generation EP rank holding a routed expert's tensor."""
        return _expert_block(spec, self.ep)

    def rows(self, spec: TensorSpec, rank: int) -> tuple[int, int] | None:
        """The rows of `spec` generation rank `rank` (global) holds; None: a routed expert of another EP rank."""
        t = rank % self.tp
        if spec.whole_for_generation:
            return 0, spec.length
        if spec.expert is None:
            return spec.rows(self.tp, t)
        if self.expert_owner(spec) != t // self.moe_tp:
            return None
        return spec.rows(self.moe_tp, t % self.moe_tp)


def as_generation(gen: int | GenLayout) -> GenLayout:
    """A generation layout from a GenLayout or a bare generation TP (EP_g = 1)."""
    return gen if isinstance(gen, GenLayout) else GenLayout(gen)


def generation_ranks(train: TrainLayout, gen: int | GenLayout) -> list[list[int]]:
    """The generation TP groups, as blocks of the training TP groups or runs of whole ones."""
    gen_tp = as_generation(gen).tp
    if train.world % gen_tp or (train.tp % gen_tp and gen_tp % train.tp):
        raise ValueError(f"generation TP={gen_tp} must divide the world ({train.world}) and divide or be a "
                         f"multiple of training TP={train.tp}")
    return [list(range(k * gen_tp, (k + 1) * gen_tp)) for k in range(train.world // gen_tp)]


def new_generation_group(train: TrainLayout, gen: int | GenLayout, backend: str | None = None):
    """This rank's generation TP group (collective: every rank builds every group, as torch requires), of the
    default backend or `backend` (gloo: the CPU objects of a sharded sync)."""
    mine = None
    for ranks in generation_ranks(train, gen):
        group = dist.new_group(ranks, backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def needed(spec: TensorSpec, gen: int | GenLayout, rank: int, delivery: str) -> tuple[int, int] | None:
    """Rows of `spec` generation rank `rank` receives: its own ("sharded"), or all of every tensor it holds any
    of ("full": whole HF tensors, the engine slices them); None: none (a routed expert of another EP_g rank)."""
    rows = as_generation(gen).rows(spec, rank)
    if rows is None or delivery == "sharded":
        return rows
    return 0, spec.length


def resharded_layout(gen: int | GenLayout, delivery: str) -> GenLayout:
    """The generation layout the resharder runs a delivery into: the engine's own for "sharded" (each rank of the
    first generation TP group gets its engine rank's rows); for "full", generation TP 1 whatever the engine's (every
    rank gathers whole HF tensors, as megatron's export does; rank 0 sends them and each engine rank slices its
    own). The planner prices the same layouts (megarl.reshard.plan)."""
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery={delivery!r}: expected one of {DELIVERIES}")
    return as_generation(gen) if delivery == "sharded" else GenLayout(1)


def sglang_generation(tp: int, extra_args) -> GenLayout:
    """The generation layout of an SGLang server of TP `tp` launched with `extra_args` (rollout.sglang_args): its
    expert parallelism as megarl.config.sglang_args.sglang_ep_size reads it (a setting that places the weights
    otherwise than this module models them is refused there, naming it)."""
    return GenLayout(tp, sglang_ep_size(extra_args))
