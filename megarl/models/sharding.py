"""Tensor-parallel rules shared by the model families: how a megatron parameter is cut from HF tensors.

A WeightMap ties one megatron GPTModel parameter (by its name with the GLOBAL layer index) to the HF
tensors it is made of (to one expert's row of them where a checkpoint stacks a layer's experts: `stacked`).
`to_shard` builds this TP rank's shard from the full HF tensors; `from_shards` turns the shards of all TP ranks (in rank order) back into the HF tensors, bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class WeightMap:
    megatron: str
    hf: tuple[str, ...]
    to_shard: Callable[[list[Tensor], int, int], Tensor]   # (hf tensors, tp_rank, tp_size) -> shard
    from_shards: Callable[[list[Tensor]], list[Tensor]]    # shards in TP rank order -> hf tensors
    export: bool = True  # False for a copy of another weight (the tied output layer on the last stage)
    # (row, rows): the HF tensors hold every expert of a layer stacked along dim 0 (gpt-oss) and this parameter is
    # row `row` of `rows`: to_shard and from_shards see that row alone; import reads it, export stacks the rows
    stacked: tuple[int, int] | None = None


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron's vocab-parallel layers need the vocabulary divisible by TP; pad rows are zero."""
    return -(-vocab_size // tp) * tp


def replicated() -> dict:
    return dict(to_shard=lambda ts, rank, size: ts[0], from_shards=lambda shards: [shards[0]])


def split_dim(dim: int) -> dict:
    """Column-parallel (dim 0) or row-parallel (dim 1) linear weights."""
    return dict(to_shard=lambda ts, rank, size: ts[0].chunk(size, dim)[rank],
                from_shards=lambda shards: [torch.cat(shards, dim)])


def vocab_rows(vocab_size: int, tp: int) -> dict:
    """Vocab-parallel embedding / output layer: pad rows to a multiple of TP with zeros, split dim 0;
    the pad rows are dropped again on the way back."""
    padded = padded_vocab_size(vocab_size, tp)

    def to_shard(ts, rank, size):
        full = ts[0]
        if padded > vocab_size:
            full = torch.cat([full, full.new_zeros(padded - vocab_size, *full.shape[1:])])
        return full.chunk(size, 0)[rank]

    return dict(to_shard=to_shard, from_shards=lambda shards: [torch.cat(shards, 0)[:vocab_size]])


def fused_qkv(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """q, k, v (weights or biases) -> megatron's linear_qkv layout: per query group, that group's
    query heads then its key head then its value head. TP ranks hold whole query groups."""
    per_group = num_heads // num_kv_heads

    def to_shard(ts, rank, size):
        q, k, v = ts
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(num_kv_heads, per_group * head_dim, *rest),
                           k.reshape(num_kv_heads, head_dim, *rest),
                           v.reshape(num_kv_heads, head_dim, *rest)], dim=1)
        return fused.reshape(-1, *rest).chunk(size, 0)[rank]

    def from_shards(shards):
        fused = torch.cat(shards, 0)
        rest = fused.shape[1:]
        q, k, v = fused.reshape(num_kv_heads, (per_group + 2) * head_dim, *rest).split(
            [per_group * head_dim, head_dim, head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]

    return dict(to_shard=to_shard, from_shards=from_shards)


def fused_gate_up() -> dict:
    """gate and up projections -> megatron's gated linear_fc1: each TP rank holds [its gate rows; its
    up rows] (megatron's MLP chunks the fc1 output in two: act(first) * second)."""

    def to_shard(ts, rank, size):
        gate, up = ts
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])

    def from_shards(shards):
        halves = [s.chunk(2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]

    return dict(to_shard=to_shard, from_shards=from_shards)


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")  # the checkpoints' names of a SwiGLU MLP's projections


def gated_mlp(megatron_prefix: str, hf_prefix: str, parts: tuple[str, str, str] = GATE_UP_DOWN) -> list[WeightMap]:
    """A SwiGLU MLP's two megatron weights from HF's gate/up/down projections (a dense MLP, an expert, a shared
    expert), named `parts` in the checkpoint (Mixtral's experts: w1, w3, w2): linear_fc1 the fused gate and up
    rows, linear_fc2 row-parallel."""
    m, h = megatron_prefix, hf_prefix
    gate, up, down = parts
    return [WeightMap(m + "linear_fc1.weight", (f"{h}{gate}.weight", f"{h}{up}.weight"), **fused_gate_up()),
            WeightMap(m + "linear_fc2.weight", (f"{h}{down}.weight",), **split_dim(1))]
