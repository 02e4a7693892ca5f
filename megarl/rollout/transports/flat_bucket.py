"""The flat bucket: a bucket's tensors back to back in one uint8 buffer (SGLang's FlattenedTensorBucket layout, no
padding), described by [name, dtype, shape, start, end] per tensor. The CUDA IPC formats "flattened_bucket" and
"persistent" post it, NCCL broadcasts it in one collective, and megarl's loader inside SGLang reads it back."""

from __future__ import annotations

import torch

from megarl.utils.checksum import ChecksumTable

Bucket = list[tuple[str, torch.Tensor]]


def flat_layout(bucket: Bucket) -> tuple[list[list], int]:
    """[name, dtype, shape, start, end] per tensor in one uint8 buffer (SGLang's FlattenedTensorBucket
    layout: tensors back to back, no padding), and the buffer's size in bytes."""
    layout, offset = [], 0
    for name, t in bucket:
        size = t.numel() * t.element_size()
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, offset + size])
        offset += size
    return layout, offset


def pack(bucket: Bucket, out: torch.Tensor, checksums: ChecksumTable | None = None) -> torch.Tensor:
    """Copy the bucket's tensors into `out` (uint8) in flat_layout order; returns the used prefix. `checksums`:
    a table with this bucket's pieces queued (a verified sync), whose flush makes the copies in the same pass
    that sums them (each weight is read once)."""
    copies, offset = [], 0
    for _, t in bucket:
        size = t.numel() * t.element_size()
        copies.append((t, out[offset:offset + size].view(t.dtype).view(t.shape)))
        offset += size
    if checksums is not None:
        checksums.flush(copies)
    else:
        for source, destination in copies:
            destination.copy_(source)
    return out[:offset]


def unpack(flat: torch.Tensor, layout: list[list]) -> Bucket:
    """Views of `flat` named and shaped as `layout` says (no copies)."""
    return [(name, flat[start:end].view(getattr(torch, dtype)).view(shape)) for name, dtype, shape, start, end in layout]
