"""Cutting a Batch into equal-shaped micro-batches for megatron's pipeline schedules.

Pipeline stages exchange activations of a fixed shape [T, micro_batch_size, hidden], so every
micro-batch has the same number of rows and columns: the batch is trimmed to its longest sequence
and the last micro-batch is filled with empty rows (attention_mask 0, loss_mask 0), which the
caller drops from the results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.protocol import Batch


def trimmed_length(batch: Batch) -> int:
    """Columns up to the longest real sequence (right padding beyond it is never needed)."""
    return max(int(batch["attention_mask"].sum(1).max()), 1)


def micro_batches(batch: Batch, keys: list[str], micro_batch_size: int, device) -> list[dict[str, Tensor]]:
    """[{key: [micro_batch_size, T] on device, 'position_ids', 'attn_mask'}] in row order.

    'attn_mask' is megatron's boolean mask [b, 1, T, T], True where attention is NOT allowed:
    causal, plus padded keys.
    """
    T = trimmed_length(batch)
    rows = len(batch)
    padded_rows = -(-rows // micro_batch_size) * micro_batch_size
    fields = {}
    for key in ["tokens", "attention_mask", *keys]:
        t = batch[key][:, :T]
        if padded_rows > rows:
            t = torch.cat([t, t.new_zeros(padded_rows - rows, T)])
        fields[key] = t.to(device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    out = []
    for start in range(0, padded_rows, micro_batch_size):
        mb = {k: v[start:start + micro_batch_size] for k, v in fields.items()}
        key_padding = mb["attention_mask"] == 0
        mb["attn_mask"] = (causal | key_padding[:, None, None, :]).contiguous()
        mb["position_ids"] = torch.arange(T, device=device).expand(len(mb["tokens"]), T)
        out.append(mb)
    return out
