"""Context parallelism (CP) without TransformerEngine: each rank of the CP group runs the model on a part of
every row and attends its queries to the keys and values of the whole row.

A row of width L (a multiple of 2*CP: packing.py's width_multiple) is cut into 2*CP chunks; CP rank r holds
chunks r and 2*CP-1-r, so every rank gets as many early (cheap) as late (expensive) causal queries. Token and
position ids are cut the same way, so RoPE (packing.reset_rotary_positions) rotates each token by its own
position in the row. Core attention all-gathers K and V over the CP group (backward: reduce-scatter of their
gradients) and masks by the global index and segment of each query and key (`attention_mask`). The
per-position outputs come back to whole rows (`gather_rows`), so next-token targets, losses and `unpack` see
the layout of CP=1. Every CP rank then computes the same loss; gather_rows' backward hands each rank only
its own positions' gradient, so the parameter gradients of the CP ranks sum to CP=1's, which is what
megatron's DDP computes over the data-and-context-parallel group (its schedule scales the loss by the CP
size, DDP averages over DP x CP).

Everything here is the identity at CP=1.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import Tensor


def size() -> int:
    return parallel_state.get_context_parallel_world_size()


@functools.cache
def _chunk_index(width: int, cp: int, rank: int) -> Tensor:
    chunk = width // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])


def chunk_index(width: int, rank: int | None = None) -> Tensor:
    """Positions of a row of `width` held by CP rank `rank` (this rank by default), in the order it holds them."""
    cp = size()
    if width % (2 * cp):
        raise ValueError(f"row width {width} is not a multiple of 2 * CP = {2 * cp}")
    return _chunk_index(width, cp, parallel_state.get_context_parallel_rank() if rank is None else rank)


def local(rows: Tensor) -> Tensor:
    """[rows, L, ...] -> this CP rank's positions [rows, L / CP, ...]."""
    if size() == 1:
        return rows
    return rows[:, chunk_index(rows.shape[1]).to(rows.device)]


def gather_rows(part: Tensor) -> Tensor:
    """This CP rank's per-position outputs [rows, L / CP, ...] -> whole rows [rows, L, ...] (every CP rank).
    Backward: this rank's positions of the gradient (each CP rank computes the same loss from the whole rows)."""
    cp = size()
    if cp == 1:
        return part
    width = part.shape[1] * cp
    gathered = gather_from_sequence_parallel_region(part.transpose(0, 1).contiguous(),
                                                    tensor_parallel_output_grad=False,
                                                    group=parallel_state.get_context_parallel_group())
    order = torch.cat([chunk_index(width, r) for r in range(cp)]).argsort().to(part.device)
    return gathered[order].transpose(0, 1)


def gather_keys_values(key: Tensor, value: Tensor, group) -> tuple[Tensor, Tensor]:
    """[s / CP, b, groups, d] of every CP rank -> [s, b, groups, d] in CP-rank order (the key order of
    `attention_mask`). Backward: the reduce-scatter that sums every rank's queries' gradients."""
    return tuple(gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
                 for x in (key, value))


def attention_mask(doc_ids: Tensor) -> Tensor:
    """megatron's boolean mask [rows, 1, L / CP, L] (True = not allowed) of this rank's queries over the keys of
    every CP rank in gather_keys_values' order: causal by position in the row, within the query's segment
    (packing.block_causal_mask at CP=1)."""
    width = doc_ids.shape[1]
    queries = chunk_index(width).to(doc_ids.device)
    keys = torch.cat([chunk_index(width, r) for r in range(size())]).to(doc_ids.device)
    later = keys[None, :] > queries[:, None]
    other_doc = doc_ids[:, queries, None] != doc_ids[:, None, keys]
    return (later | other_doc).unsqueeze(1)
