"""How a rollout engine holds the HF tensors it is sent, and the checksums its parameters must have.

Verification after a sync compares checksums (megarl.utils.checksum) of every parameter the engine holds,
computed by the engine itself where the weights live (inside SGLang's TP workers, on their GPUs), with
checksums the sending training rank computes from what it sent. The engine's parameters are not the HF
tensors: SGLang fuses q/k/v into qkv_proj and gate/up into gate_up_proj, stacks experts into w13/w2, keeps
one TP shard per rank and pads the vocabulary with zero rows. The checksums compose (a fused parameter's
checksum is the sum of its pieces' at their positions), so the sender applies the same layout piece by piece
without building any fused tensor: `ExpectedChecksums`.

Layouts, by rollout engine:
- `hf` (transformers, CPU): every HF tensor whole under its own name (one rank). Sharded delivery sends row
  blocks: each lands at its rows of the whole tensor.
- `sglang`: SGLang 0.5.17's dense and MoE decoders (qwen2, llama, qwen3, qwen3_moe) at TP=tp: stacked
  parameters as its `stacked_params_mapping` and `FusedMoE.make_expert_params_mapping` name them; column-
  parallel rows and row-parallel columns as megarl's inventory cuts them (K/V heads replicated above their
  count); vocabulary rows as VocabParallelEmbedding cuts a vocabulary padded to a multiple of 64, its padding
  rows zero-filled (they add nothing to a checksum).
"""

from __future__ import annotations

import re

import torch

from megarl.utils.checksum import ChecksumTable

SGLANG_VOCAB_PADDING = 64  # sglang's DEFAULT_VOCAB_PADDING_SIZE
# HF name -> (SGLang's parameter, the part's place among the parameter's parts, all parts)
_STACKED = (
    (re.compile(r"(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$"), "{0}qkv_proj.{2}", ("q", "k", "v")),
    (re.compile(r"(.*\.mlp\.)(gate|up)_proj\.weight$"), "{0}gate_up_proj.weight", ("gate", "up")),
)
_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")

Key = str | tuple  # an HF name, or (name, dim, lo, hi): rows [lo, hi) of it along dim (weight_sync.Key)


class WeightLayout:
    """Where each HF tensor's rows land in the engine's parameters, per engine TP rank."""

    def __init__(self, specs: list, engine: str, tp: int = 1):
        if engine not in ("hf", "sglang"):
            raise ValueError(f"no weight layout for rollout engine {engine!r}")
        self.specs = {s.name: s for s in specs}
        self.engine, self.tp = engine, tp if engine == "sglang" else 1

    def rows(self, name: str, rank: int) -> tuple[int, int]:
        """[lo, hi) of HF tensor `name` along its split dimension that engine rank `rank` holds."""
        spec = self.specs[name]
        if spec.pad_vocab and self.engine == "sglang":
            per = -(-spec.length // SGLANG_VOCAB_PADDING) * SGLANG_VOCAB_PADDING // self.tp
            return min(rank * per, spec.length), min((rank + 1) * per, spec.length)
        return spec.rows(self.tp, rank) if self.engine == "sglang" else (0, spec.length)

    def piece(self, key: Key, tensor: torch.Tensor, rank: int, presharded: bool):
        """(engine parameter, the piece of `tensor` it holds, the piece's offset in it, the parameter's row
        length for the piece (None: the piece is contiguous there)) for engine rank `rank`. `presharded`:
        `tensor` is already what this rank holds of the HF tensor (sharded delivery into SGLang)."""
        name = key if isinstance(key, str) else key[0]
        spec = self.specs[name]
        if self.engine == "hf":
            if isinstance(key, str):
                return name, tensor, 0, None
            _, dim, lo, _ = key
            if dim == 0:
                return name, tensor, lo * spec.row_numel, None
            return name, tensor, lo, spec.shape[1]  # columns [lo, hi) of every row
        piece = tensor
        if spec.dim is not None and not presharded:
            lo, hi = self.rows(name, rank)
            piece = tensor.narrow(spec.dim, lo, hi - lo)
        param, offset = self.place(name, rank)
        return param, piece, offset, None

    def place(self, name: str, rank: int) -> tuple[str, int]:
        """SGLang's parameter holding HF tensor `name` on rank `rank`, and the element offset of its piece there."""
        expert = _EXPERT.match(name)
        if expert:
            prefix, index, part = expert.group(1), int(expert.group(2)), expert.group(3)
            gate = f"{prefix}{index}.gate_proj.weight"
            lo, hi = self.rows(gate, rank)
            shard = (hi - lo) * self.specs[gate].row_numel  # one expert's gate (or up, or down) shard
            if part == "down":
                return prefix + "w2_weight", index * shard
            return prefix + "w13_weight", (2 * index + (part == "up")) * shard
        for pattern, fused, parts in _STACKED:
            match = pattern.match(name)
            if match:
                offset = 0
                for part in parts[:parts.index(match.group(2))]:
                    sibling = name.replace(f"{match.group(2)}_proj", f"{part}_proj")
                    lo, hi = self.rows(sibling, rank)
                    offset += (hi - lo) * self.specs[sibling].row_numel
                return fused.format(*match.groups()), offset
        return name, 0


class ExpectedChecksums:
    """What the engine's parameters must hash to after a sync, accumulated bucket by bucket on the sender's
    device into one table (no host sync until `result`)."""

    def __init__(self, layout: WeightLayout, ranks: list[int], presharded: bool = False,
                 sender: tuple[int, int] | None = None):
        """`sender` = (generation rank, generation TP) of a sharded delivery into an engine holding whole tensors:
        every generation rank sends the replicated tensors (and K/V heads replicated above their count) and the
        engine keeps one copy, so this sender counts only the rows no lower rank also sends."""
        self.layout, self.ranks, self.presharded, self.sender = layout, ranks, presharded, sender
        params = dict.fromkeys((rank, layout.place(name, rank)[0] if layout.engine == "sglang" else name)
                               for rank in ranks for name in layout.specs)
        self.rows = {key: row for row, key in enumerate(params)}  # every parameter a sync can reach
        self.table: ChecksumTable | None = None  # on the device of the first tensor sent
        self.dtypes: dict[tuple[int, str], torch.dtype] = {}

    def add(self, key: Key, tensor: torch.Tensor) -> None:
        if self.sender is not None and not self._first_to_send(key):
            return
        if self.table is None:
            self.table = ChecksumTable(len(self.rows), tensor.device)
        for rank in self.ranks:
            param, piece, offset, stride = self.layout.piece(key, tensor, rank, self.presharded)
            self.table.add(self.rows[(rank, param)], piece, offset, stride)
            self.dtypes[(rank, param)] = tensor.dtype

    def flush(self) -> None:
        """Queue the sums of what was added on the device (before the tensors' memory may be reused)."""
        if self.table is not None:
            self.table.flush()

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
