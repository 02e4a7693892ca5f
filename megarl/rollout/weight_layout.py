"""How a rollout engine holds the HF tensors it is sent, and the checksums its parameters must have.

Verification after a sync compares checksums (megarl.utils.checksum) of every parameter the engine holds,
computed by the engine itself where the weights live (inside SGLang's TP workers, on their GPUs), with
checksums the sending training rank computes from what it sent. The engine's parameters are not the HF
tensors: SGLang fuses q/k/v into qkv_proj and gate/up into gate_up_proj, stacks experts into w13/w2, keeps
one TP shard per rank and pads the vocabulary with zero rows. The checksums compose (a fused parameter's
checksum is the sum of its pieces' at their positions), so the sender applies the same layout piece by piece
without building any fused tensor: `ExpectedChecksums`.

Layouts (`WeightLayout`), by rollout engine (`layout_for`):
- `hf` (transformers, CPU): every HF tensor whole under its own name (one rank), `HFLayout`, stacked experts as
  their checkpoint's stacked tensors. Sharded delivery sends row blocks: each lands at its rows of the whole tensor.
- `sglang`: SGLang's fused, sharded, padded parameters, `megarl.rollout.sglang_layout.SGLangLayout`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megarl.reshard.inventory import stacked_rows, stacked_whole
from megarl.rollout.sglang_layout import SGLangLayout
from megarl.utils.checksum import ChecksumTable

Key = str | tuple  # an HF name, or (name, dim, lo, hi): rows [lo, hi) of it along dim (sync_checks.Key)


class WeightLayout(Protocol):
    """Where each HF tensor's rows land in the engine's parameters, per engine TP rank."""

    specs: dict  # HF name -> megarl's inventory TensorSpec
    tp: int  # the engine's TP ranks

    def rows(self, name: str, rank: int) -> tuple[int, int] | None:
        """[lo, hi) of HF tensor `name` along its split dimension that engine rank `rank` holds; None: it holds
        none of it (a routed expert of another EP rank)."""

    def piece(self, key: Key, tensor: torch.Tensor, rank: int, presharded: bool):
        """(engine parameter, the piece of `tensor` it holds, the piece's offset in it, the parameter's row
        length for the piece (None: the piece is contiguous there)) for engine rank `rank`, or None where that rank
        holds none of it. `presharded`: `tensor` is already what this rank holds of the HF tensor (sharded
        delivery into SGLang)."""

    def parameters(self, rank: int) -> list[str]:
        """Every parameter (and derived tensor) of the engine's rank `rank` that a sync reaches."""

    def as_held(self, param: str, piece: torch.Tensor) -> torch.Tensor:
        """The piece in the dtype the engine holds `param` in."""

    def derived(self, name: str, piece: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors the engine derives from `piece`, its rank's rows of HF tensor `name`, each as a view (or
        copy) in the derived tensor's logical element order."""


class HFLayout:
    """The "hf" weight layout: every HF tensor whole under its own name, on one rank."""

    tp = 1

    def __init__(self, specs: list):
        self.specs = {s.name: s for s in specs}

    def rows(self, name: str, rank: int) -> tuple[int, int]:
        return 0, self.specs[name].length

    def piece(self, key: Key, tensor: torch.Tensor, rank: int, presharded: bool):
        if isinstance(key, str):
            return key, tensor, 0, None
        name, dim, lo, _ = key
        spec = self.specs[name]
        if dim == 0:
            return name, tensor, lo * spec.row_numel, None
        return name, tensor, lo, spec.shape[1]  # columns [lo, hi) of every row

    def parameters(self, rank: int) -> list[str]:
        return list(self.specs)

    def as_held(self, param: str, piece: torch.Tensor) -> torch.Tensor:
        return piece

    def derived(self, name: str, piece: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return []


def layout_for(specs: list, engine: str, tp: int = 1, hf: dict | None = None, sglang_args=()) -> WeightLayout:
    """The weight layout of rollout engine `engine` (rollout.engine) at TP `tp` (SGLangLayout's arguments). Stacked
    experts (gpt-oss, Qwen3-VL-MoE) arrive whole under their checkpoint names (inventory.stacked_whole); how
    SGLang's FusedMoE holds them (transposed into w13/w2, gpt-oss's gate and up interleaved, cut per MoE TP rank) is
    not modelled, so checksums of them are refused there rather than passed unchecked."""
    if engine == "hf":
        return HFLayout(stacked_whole(specs))
    if engine == "sglang":
        if stacked_rows(specs):
            raise ValueError("checksum verification of SGLang's weights does not model the stacked experts' FusedMoE "
                             "layout (gpt-oss, Qwen3-VL-MoE): verify with trainer.verify_weight_sync_deep=true "
                             "(SGLang reloads what was sent with its own loader and compares) or not at all "
                             "(trainer.verify_weight_sync_every=0)")
        return SGLangLayout(specs, tp, hf=hf, sglang_args=sglang_args)
    raise ValueError(f"no weight layout for rollout engine {engine!r}")


class ExpectedChecksums:
    """What the engine's parameters must hash to after a sync, accumulated bucket by bucket on the sender's
    device into one table (no host sync until `result`; `fetch` queues its read-back first).

    One instance serves every sync of a run, each started by `begin`: where each tensor's pieces go in the engine's
    parameters (the layout's lookups, ~17 us a tensor) is worked out at a key's first sync and kept as views of
    the tensor sent (`plans`: sizes, strides, storage offset); later syncs take the same views of the new tensor
    of the same shape, strides and dtype."""

    def __init__(self, layout: WeightLayout, ranks: list[int], presharded: bool = False,
                 sender: tuple[int, int] | None = None):
        """`sender` = (generation rank, generation TP) of a sharded delivery into an engine holding whole tensors:
        every generation rank sends the replicated tensors (and K/V heads replicated above their count) and the
        engine keeps one copy, so this sender counts only the rows no lower rank also sends."""
        self.layout, self.ranks, self.presharded, self.sender = layout, ranks, presharded, sender
        params = [(rank, param) for rank in ranks for param in layout.parameters(rank)]
        self.rows = {key: row for row, key in enumerate(params)}  # every parameter a sync can reach
        self.table: ChecksumTable | None = None  # on the device of the first tensor sent
        self.dtypes: dict[tuple[int, str], torch.dtype] = {}
        # key -> ((shape, strides, dtype) of the tensor planned for, [(table row, (rank, parameter), view of the
        # tensor as (size, stride, storage offset from the tensor's) or None for the tensor itself, dtype held in
        # or None, offset, row length)], or None where a piece is no view of the tensor: the layout every sync)
        self.plans: dict[Key, tuple] = {}

    def begin(self) -> None:
        """Start a sync: the last one's sums and dtypes go (queued on the device: no host sync); the table and the
        plans stay."""
        if self.table is not None:
            self.table.reset()
        self.dtypes = {}

    def add(self, key: Key, tensor: torch.Tensor) -> None:
        if self.table is None:
            self.table = ChecksumTable(len(self.rows), tensor.device)
        geometry = (tensor.shape, tensor.stride(), tensor.dtype)
        plan = self.plans.get(key)
        if plan is None or plan[0] != geometry:
            plan = self.plans[key] = (geometry, self._plan(key, tensor))
        steps = plan[1] if plan[1] is not None else self._pieces(key, tensor)
        base = tensor.storage_offset()
        for row, param, view, held, offset, stride in steps:
            if not isinstance(view, torch.Tensor):
                view = tensor if view is None else tensor.as_strided(view[0], view[1], base + view[2])
            piece = view if held is None else view.to(held)
            self.table.add(row, piece, offset, stride)
            self.dtypes[param] = piece.dtype

    def _pieces(self, key: Key, tensor: torch.Tensor):
        """(table row, (engine rank, parameter), piece as sent, dtype the engine holds it in if another, offset,
        row length) of every piece of `tensor` in the engine's parameters and derived tensors, from the layout."""
        if self.sender is not None and not self._first_to_send(key):
            return
        name = key if isinstance(key, str) else key[0]
        for rank in self.ranks:
            placed = self.layout.piece(key, tensor, rank, self.presharded)
            if placed is None:  # a routed expert another EP rank holds
                continue
            param, piece, offset, stride = placed
            held = self.layout.as_held(param, piece).dtype  # the planning's one conversion (a few small tensors)
            yield self.rows[(rank, param)], (rank, param), piece, held if held != piece.dtype else None, offset, stride
            for derived, value in self.layout.derived(name, piece):
                yield self.rows[(rank, derived)], (rank, derived), value, None, 0, None

    def _plan(self, key: Key, tensor: torch.Tensor) -> list[tuple] | None:
        """`_pieces` with each piece as a view of `tensor` (None: the tensor itself); None if one is not a view."""
        storage, steps = tensor.untyped_storage().data_ptr(), []
        for row, param, piece, held, offset, stride in self._pieces(key, tensor):
            if piece.dtype != tensor.dtype or piece.untyped_storage().data_ptr() != storage:
                return None
            same = (piece.shape == tensor.shape and piece.stride() == tensor.stride()
                    and piece.storage_offset() == tensor.storage_offset())
            shift = piece.storage_offset() - tensor.storage_offset()
            steps.append((row, param, None if same else (tuple(piece.shape), piece.stride(), shift), held, offset,
                          stride))
        return steps

    def flush(self) -> None:
        """Queue the sums of what was added on the device (before the tensors' memory may be reused)."""
        if self.table is not None:
            self.table.flush()

    def fetch(self) -> None:
        """Queue the sums' read-back (no host sync): a sync calls it once its last bucket is sent."""
        if self.table is not None:
            self.table.fetch()

    def _first_to_send(self, key: Key) -> bool:
        rank, tp = self.sender
        if isinstance(key, str):
            return rank == 0
        spec = self.layout.specs[key[0]]
        return rank == min(r for r in range(tp) if spec.rows(tp, r) == tuple(key[2:4]))

    def result(self) -> dict[tuple[int, str], tuple[str, int, int]]:
        """(engine rank, parameter) -> (dtype, sum 0, sum 1) of every parameter something was sent to."""
        if self.table is None:
            return {}
        values = self.table.values()
        return {key: (str(dtype), *values[self.rows[key]]) for key, dtype in self.dtypes.items()}


def merge(expected: list[dict]) -> dict:
    """Several senders' expected checksums (sharded delivery: one per engine rank) as one; a parameter two
    senders both cover gets the sum of their pieces (mod 2^32, as the checksum itself)."""
    out: dict = {}
    for part in expected:
        for key, (dtype, s0, s1) in part.items():
            if key in out:
                _, a0, a1 = out[key]
                s0, s1 = (a0 + s0) & 0xFFFFFFFF, (a1 + s1) & 0xFFFFFFFF
            out[key] = (dtype, s0, s1)
    return out
