"""Bitwise checksums of tensors that compose: the checksum of a tensor assembled from pieces (SGLang's fused
qkv_proj from HF's q/k/v, a TP shard, a vocabulary padded with zero rows) is the sum of its pieces' checksums,
each computed at the positions the piece takes in the whole. A sender can therefore compute what a receiver's
fused, sharded parameter must hash to without building it.

A tensor's checksum is two sums mod 2^32 over its elements' bits x_i (a signed integer view of 1, 2 or 4 bytes:
-0.0 != 0.0, NaNs compare; 8-byte elements count as two 4-byte words) of x_i * w_i, with odd position weights
w_i = (i * m mod 2^32) | 1, one sum per multiplier m. Modular sums do not depend on the order of addition (equal
on CPU and GPU, any chunking, any split into pieces); an odd weight is invertible mod 2^32 and a single element
changes by less than 2^32, so changing any single element always changes both sums. Zero elements contribute
nothing: padding filled with zeros needs no piece. All arithmetic is 32-bit on the GPU, so the kernel keeps up
with memory bandwidth (a 7B policy is 15 GB to read on each side of a verified sync).

`ChecksumTable` accumulates the pieces of many tensors into one int32 table on their device (Triton: one
kernel launch for all queued pieces of an integer width, each program atomically adding a block's sums to its
tensor's row: a launch per piece cost more than the sums themselves), read back with one host sync; elsewhere
the sums are computed with torch ops in chunks.
"""

from __future__ import annotations

from typing import Iterable

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # integer views by element size (8: two int32 words)
MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)
_CHUNK = 1 << 24  # torch path: elements per chunk (a few int64 copies of it in temporary memory)
_BLOCK = 4096  # Triton path: elements per loop iteration of a program
_ITERS = 4  # iterations per program: 16k elements, then one atomic add per sum

try:  # Triton comes with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    @triton.jit(do_not_specialize=["segments"])
    def _segment_sums_kernel(block_segment_ptr, meta_ptr, segments, out_ptr, DTYPE: tl.constexpr,
                             M0: tl.constexpr, M1: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        """One program: BLOCK * ITERS elements of one segment (a contiguous run of a piece, `meta` columns:
        address, length, position of its first element in its tensor, first block, table row)."""
        pid = tl.program_id(0).to(tl.int64)
        segment = tl.load(block_segment_ptr + pid).to(tl.int64)
        address = tl.load(meta_ptr + segment)
        length = tl.load(meta_ptr + segments + segment)
        position = tl.load(meta_ptr + 2 * segments + segment)
        start = (pid - tl.load(meta_ptr + 3 * segments + segment)) * (BLOCK * ITERS)
        row = tl.load(meta_ptr + 4 * segments + segment)
        x_ptr = address.to(tl.pointer_type(DTYPE))
        base = (position + start).to(tl.uint32)  # positions mod 2^32: all the weights depend on
        m0 = tl.full([BLOCK], M0, tl.uint32)  # 32-bit constants: a plain literal would promote the products to 64 bits
        m1 = tl.full([BLOCK], M1, tl.uint32)
        s0 = tl.zeros([BLOCK], dtype=tl.uint32)
        s1 = tl.zeros([BLOCK], dtype=tl.uint32)
        for k in range(ITERS):
            step = k * BLOCK + tl.arange(0, BLOCK)
            mask = start + step < length
            x = tl.load(x_ptr + start + step, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            index = base + step.to(tl.uint32)
            s0 += x * ((index * m0) | 1)
            s1 += x * ((index * m1) | 1)
        tl.atomic_add(out_ptr + 2 * row, tl.sum(s0, axis=0).to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_add(out_ptr + 2 * row + 1, tl.sum(s1, axis=0).to(tl.int32, bitcast=True), sem="relaxed")

    _TRITON_BITS = {torch.uint8: tl.uint8, torch.int16: tl.int16, torch.int32: tl.int32}


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's bits as a 2-D integer [rows, cols] view whose rows are contiguous (a copy only when they are
    not: a column slice of a row-major matrix keeps its rows contiguous, so TP shards need none), and the words
    per element (2 for 8-byte elements)."""
    bits = t.detach()
    if bits.dim() == 0:
        bits = bits.reshape(1)
    if bits.dim() != 2:
        bits = bits.reshape(-1, bits.shape[-1]) if bits.dim() > 2 and bits.is_contiguous() else bits.reshape(1, -1)
    if bits.stride(-1) != 1 or (bits.shape[0] > 1 and bits.stride(0) < bits.shape[1]):
        bits = bits.contiguous()
    if t.element_size() == 8:
        return bits.view(torch.int32), 2
    return bits.view(_BITS[t.element_size()]), 1


class ChecksumTable:
    """Checksums of `size` tensors, each accumulated from pieces (`add`) into its row of an int32 table on
    `device`; `values()` reads them all at once. On a GPU the pieces are queued and summed by one kernel launch
    per integer width (`flush`, which must run before a queued piece's memory is reused: push_policy flushes
    each bucket); elsewhere each piece is summed when added."""

    def __init__(self, size: int, device: torch.device | str):
        self.table = torch.zeros(size, len(MULTIPLIERS), dtype=torch.int32, device=device)
        self.queued: dict[torch.dtype, list] = {}  # integer width -> [(bits, table row, first position, stride)]

    def add(self, row: int, t: torch.Tensor, offset: int = 0, target_stride: int | None = None) -> None:
        """Add `t` placed in tensor `row`: its element (r, c) (row-major over t viewed as 2-D, 1-D tensors one row)
        sits at flat position offset + r * target_stride + c of that tensor (target_stride: the tensor's row
        length; default t's own, so a contiguous piece at `offset`)."""
        bits, words = _as_rows(t)
        rows, cols = bits.shape
        stride = cols if target_stride is None else target_stride * words
        if stride == cols and bits.is_contiguous():  # one run of positions
            bits = bits.view(1, -1)
        if bits.numel() == 0:
            return
        if triton is None or not bits.is_cuda:
            self.table[row] += _torch_sums(bits, offset * words, stride).to(self.table.device)
        else:
            self.queued.setdefault(bits.dtype, []).append((bits, row, offset * words, stride))

    def flush(self) -> None:
        """Launch the sums of every queued piece (no host sync)."""
        import numpy as np

        for dtype, pieces in self.queued.items():
            address, length, position, row = [], [], [], []
            for bits, table_row, first, stride in pieces:
                rows, cols = bits.shape
                r = np.arange(rows, dtype=np.int64)
                address.append(bits.data_ptr() + r * bits.stride(0) * bits.element_size())
                length.append(np.full(rows, cols, dtype=np.int64))
                position.append(first + r * stride)
                row.append(np.full(rows, table_row, dtype=np.int64))
            length = np.concatenate(length)
            blocks = -(-length // (_BLOCK * _ITERS))
            first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
            meta = np.concatenate([np.concatenate(address), length, np.concatenate(position), first_block,
                                   np.concatenate(row)])
            block_segment = np.repeat(np.arange(len(length), dtype=np.int32), blocks)
            device = self.table.device
            _segment_sums_kernel[(len(block_segment),)](
                torch.from_numpy(block_segment).to(device), torch.from_numpy(meta).to(device), len(length),
                self.table, DTYPE=_TRITON_BITS[dtype], M0=MULTIPLIERS[0], M1=MULTIPLIERS[1], BLOCK=_BLOCK, ITERS=_ITERS)
        self.queued = {}

    def values(self) -> list[list[int]]:
        """Each tensor's sums as non-negative ints below 2^32 (one host sync)."""
        self.flush()
        return (self.table.cpu().to(torch.int64) & 0xFFFFFFFF).tolist()


def _torch_sums(bits: torch.Tensor, offset: int, stride: int) -> torch.Tensor:
    """The sums as int32 (wrapped), with int64 arithmetic (exact mod 2^64, hence mod 2^32)."""
    rows, cols = bits.shape
    sums = torch.zeros(len(MULTIPLIERS), dtype=torch.int64, device=bits.device)
    per = max(1, _CHUNK // cols)  # whole rows per chunk
    columns = torch.arange(cols, dtype=torch.int64, device=bits.device)
    for start in range(0, rows, per):
        x = bits[start:start + per].to(torch.int64)
        first = torch.arange(start, start + x.shape[0], dtype=torch.int64, device=bits.device) * stride + offset
        index = (first[:, None] + columns[None, :]) & 0xFFFFFFFF
        for k, m in enumerate(MULTIPLIERS):
            sums[k] += (x * ((index * m) & 0xFFFFFFFF | 1)).sum()
    wrapped = sums & 0xFFFFFFFF
    return torch.where(wrapped >= 1 << 31, wrapped - (1 << 32), wrapped).to(torch.int32)


def weighted_sums(t: torch.Tensor, offset: int = 0, target_stride: int | None = None) -> torch.Tensor:
    """One piece's sums ([2] int32 on t's device, no host sync), placed as ChecksumTable.add says."""
    table = ChecksumTable(1, t.device)
    table.add(0, t, offset, target_stride)
    table.flush()
    return table.table[0]


def checksums(tensors) -> list[torch.Tensor]:
    """Each tensor's own sums ([2] int32 on its device, no host sync: read them all at once)."""
    return [weighted_sums(t) for t in tensors]


def module_checksums(model, extra: Iterable[tuple[str, torch.Tensor]] = ()) -> dict[str, list]:
    """name -> [dtype, shape, sum 0, sum 1, is_buffer] of every parameter and persistent buffer `model` holds (a
    torch module; or any object with named_parameters()), and of the `extra` tensors (counted as parameters: what
    a model derives from its weights, such as SGLang's MLA w_kc/w_vc), read from the device at once. Non-persistent
    buffers (rotary caches) are derived from the config, not weights: left out, as SGLang's own weights checker
    does. A non-contiguous tensor is summed in its logical element order."""
    named = [(name, t, False) for name, t in model.named_parameters()]
    named += [(name, t, False) for name, t in extra]
    if isinstance(model, torch.nn.Module):
        for prefix, module in model.named_modules():
            for name, t in module._buffers.items():
                if t is not None and name not in module._non_persistent_buffers_set:
                    named.append((f"{prefix}.{name}" if prefix else name, t, True))
    if not named:
        return {}
    table = ChecksumTable(len(named), named[0][1].device)
    for row, (_, t, _) in enumerate(named):
        table.add(row, t)
    return {name: [str(t.dtype), list(t.shape), *v, buffer] for (name, t, buffer), v in zip(named, table.values())}


def flip_bit(t: torch.Tensor) -> None:
    """Flip the lowest bit of a tensor's first element in place (a test hook: memory corrupted after a load); any
    strides (SGLang's w_kc is a transposed view)."""
    t.data.as_strided((1,), (1,)).view(torch.uint8)[:1].bitwise_xor_(1)
