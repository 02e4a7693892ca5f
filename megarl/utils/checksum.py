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
kernel launch per piece, atomically added to its tensor's row), read back with one host sync; elsewhere the
sums are computed with torch ops in chunks.
"""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # integer views by element size (8: two int32 words)
MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)
_CHUNK = 1 << 24  # torch path: elements per chunk (a few int64 copies of it in temporary memory)
_BLOCK = 4096  # Triton path: elements per loop iteration of a program
_ITERS = 4  # iterations per program: 16k elements, then one atomic add per sum
_MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's second dimension

try:  # Triton comes with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Not specialised on its integer arguments' values (Triton's default compiles a variant per pattern of
    # ==1 and %16 among them: a sync's pieces, at their many offsets, paid seconds of compilation)
    @triton.jit(do_not_specialize=["cols", "row_stride", "offset", "target_stride"])
    def _weighted_sums_kernel(x_ptr, out_ptr, cols, row_stride, offset, target_stride,
                              M0: tl.constexpr, M1: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        first = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
        base = (offset + row * target_stride).to(tl.uint32)  # positions mod 2^32: all the weights depend on
        m0 = tl.full([BLOCK], M0, tl.uint32)  # 32-bit constants: a plain literal would promote the products to 64 bits
        m1 = tl.full([BLOCK], M1, tl.uint32)
        s0 = tl.zeros([BLOCK], dtype=tl.uint32)
        s1 = tl.zeros([BLOCK], dtype=tl.uint32)
        for k in range(ITERS):
            col = first + k * BLOCK + tl.arange(0, BLOCK)
            mask = col < cols
            x = tl.load(x_ptr + row * row_stride + col, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            index = base + col.to(tl.uint32)
            s0 += x * ((index * m0) | 1)
            s1 += x * ((index * m1) | 1)
        tl.atomic_add(out_ptr, tl.sum(s0, axis=0).to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_add(out_ptr + 1, tl.sum(s1, axis=0).to(tl.int32, bitcast=True), sem="relaxed")


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
    `device`; `values()` reads them all at once."""

    def __init__(self, size: int, device: torch.device | str):
        self.table = torch.zeros(size, len(MULTIPLIERS), dtype=torch.int32, device=device)

    def add(self, row: int, t: torch.Tensor, offset: int = 0, target_stride: int | None = None) -> None:
        """Add `t` placed in tensor `row`: its element (r, c) (row-major over t viewed as 2-D, 1-D tensors one row)
        sits at flat position offset + r * target_stride + c of that tensor (target_stride: the tensor's row
        length; default t's own, so a contiguous piece at `offset`)."""
        bits, words = _as_rows(t)
        rows, cols = bits.shape
        stride = cols if target_stride is None else target_stride * words
        offset *= words
        if stride == cols and bits.is_contiguous():  # one run of positions: a single row (few grid rows allowed)
            bits, rows, cols = bits.view(1, -1), 1, rows * cols
        if rows * cols == 0:
            return
        out = self.table[row]
        if triton is None or not bits.is_cuda:
            out += _torch_sums(bits, offset, stride).to(out.device)
            return
        for first in range(0, rows, _MAX_GRID_ROWS):
            part = bits[first:first + _MAX_GRID_ROWS]
            grid = (triton.cdiv(cols, _BLOCK * _ITERS), part.shape[0])
            _weighted_sums_kernel[grid](part, out, cols, part.stride(0), offset + first * stride, stride,
                                        M0=MULTIPLIERS[0], M1=MULTIPLIERS[1], BLOCK=_BLOCK, ITERS=_ITERS)

    def values(self) -> list[list[int]]:
        """Each tensor's sums as non-negative ints below 2^32 (one host sync)."""
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
    return table.table[0]


def checksums(tensors) -> list[torch.Tensor]:
    """Each tensor's own sums ([2] int32 on its device, no host sync: read them all at once)."""
    return [weighted_sums(t) for t in tensors]


def module_checksums(model) -> dict[str, list]:
    """name -> [dtype, shape, sum 0, sum 1, is_buffer] of every parameter and persistent buffer `model` holds (a
    torch module; or any object with named_parameters()), read from the device at once. Non-persistent buffers
    (rotary caches) are derived from the config, not weights: left out, as SGLang's own weights checker does."""
    named = [(name, t, False) for name, t in model.named_parameters()]
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
    """Flip the lowest bit of a tensor's first element in place (a test hook: memory corrupted after a load)."""
    t.data.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
