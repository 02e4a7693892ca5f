"""Bitwise checksums of tensors that compose: the checksum of a tensor assembled from pieces (SGLang's fused
qkv_proj from HF's q/k/v, a TP shard, a vocabulary padded with zero rows) is the sum of its pieces' checksums,
each computed at the positions the piece takes in the whole. A sender can therefore compute what a receiver's
fused, sharded parameter must hash to without building it.

A tensor's checksum is two int64 sums over its elements' bits x_i (an integer view: -0.0 != 0.0, NaNs
compare) of x_i * w_i, with odd position weights w_i = ((i mod 2^31) * m mod 2^32) | 1, one sum per multiplier
m. The sums wrap (arithmetic mod 2^64), so they do not depend on reduction order (equal on CPU and GPU, any
chunking or split into pieces); an odd weight is invertible mod 2^64, so changing any single element always
changes both sums. Zero elements contribute nothing: padding filled with zeros needs no piece.

On a GPU with Triton the sums are one bandwidth-bound kernel per piece (the verification of a 7B policy reads
15 GB on each side); elsewhere they are computed with torch ops in chunks.
"""

from __future__ import annotations

import torch

# Integer views by element size: the checksum reads a tensor's bits, not its values
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)
_CHUNK = 1 << 24  # torch path: elements per chunk (a few int64 copies of it in temporary memory)
_BLOCK = 4096  # Triton path: elements per program
_MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's second dimension

try:  # Triton comes with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Not specialised on its integer arguments' values (Triton's default compiles a variant per pattern of
    # ==1 and %16 among them: a sync's pieces, at their many offsets, paid seconds of compilation)
    @triton.jit(do_not_specialize=["cols", "row_stride", "offset", "target_stride", "col_blocks"])
    def _weighted_sums_kernel(x_ptr, out_ptr, cols, row_stride, offset, target_stride, col_blocks,
                              M0: tl.constexpr, M1: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        block = tl.program_id(0).to(tl.int64)
        col = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = col < cols
        x = tl.load(x_ptr + row * row_stride + col, mask=mask, other=0).to(tl.int64)
        index = (offset + row * target_stride + col) & 0x7FFFFFFF
        s0 = tl.sum(x * (((index * M0) & 0xFFFFFFFF) | 1), axis=0)
        s1 = tl.sum(x * (((index * M1) & 0xFFFFFFFF) | 1), axis=0)
        slot = (row * col_blocks + block) * 2
        tl.store(out_ptr + slot, s0)
        tl.store(out_ptr + slot + 1, s1)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """The tensor's integer bits as a 2-D [rows, cols] view whose rows are contiguous (a copy only when they
    are not: a column slice of a row-major matrix keeps its rows contiguous, so TP shards need none)."""
    bits = t.detach()
    if bits.dim() == 0:
        bits = bits.reshape(1)
    if bits.dim() != 2:
        bits = bits.reshape(-1, bits.shape[-1]) if bits.dim() > 2 and bits.is_contiguous() else bits.reshape(1, -1)
    if bits.stride(-1) != 1:
        bits = bits.contiguous()
    if bits.dim() == 2 and bits.shape[0] > 1 and bits.stride(0) < bits.shape[1]:
        bits = bits.contiguous()
    return bits.view(_BITS[t.element_size()])


def weighted_sums(t: torch.Tensor, offset: int = 0, target_stride: int | None = None) -> torch.Tensor:
    """The two sums ([2] int64 on t's device; no host sync) of `t` placed in a larger tensor: its element
    (r, c) (row-major over t viewed as 2-D, 1-D tensors one row) sits at flat position offset + r *
    target_stride + c of the whole (target_stride: the whole's row length; default t's own, so a contiguous
    piece at `offset`)."""
    bits = _as_rows(t)
    rows, cols = bits.shape
    stride = cols if target_stride is None else target_stride
    if stride == cols and bits.is_contiguous():  # one run of positions: a single row (Triton's grid rows are few)
        bits, rows, cols = bits.view(1, -1), 1, rows * cols
    if rows * cols == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    if triton is None or not bits.is_cuda:
        return _torch_sums(bits, offset, stride)
    sums = []
    for first in range(0, rows, _MAX_GRID_ROWS):
        part = bits[first:first + _MAX_GRID_ROWS]
        col_blocks = triton.cdiv(cols, _BLOCK)
        partial = torch.empty(part.shape[0] * col_blocks * 2, dtype=torch.int64, device=bits.device)
        _weighted_sums_kernel[(col_blocks, part.shape[0])](part, partial, cols, part.stride(0), offset + first * stride,
                                                           stride, col_blocks, M0=MULTIPLIERS[0], M1=MULTIPLIERS[1],
                                                           BLOCK=_BLOCK)
        sums.append(partial.view(-1, 2).sum(0))
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum(0)


def _torch_sums(bits: torch.Tensor, offset: int, stride: int) -> torch.Tensor:
    rows, cols = bits.shape
    sums = torch.zeros(len(MULTIPLIERS), dtype=torch.int64, device=bits.device)
    per = max(1, _CHUNK // cols)  # whole rows per chunk
    columns = torch.arange(cols, dtype=torch.int64, device=bits.device)
    for start in range(0, rows, per):
        x = bits[start:start + per].to(torch.int64)
        first = torch.arange(start, start + x.shape[0], dtype=torch.int64, device=bits.device) * stride + offset
        index = (first[:, None] + columns[None, :]) & 0x7FFFFFFF
        for k, m in enumerate(MULTIPLIERS):
            sums[k] += (x * ((index * m) & 0xFFFFFFFF | 1)).sum()
    return sums


def checksums(tensors) -> list[torch.Tensor]:
    """Each tensor's own sums ([2] int64 on its device, no host sync: read them all at once)."""
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
    sums = [weighted_sums(t) for _, t, _ in named]
    sums = torch.stack([s.to(sums[0].device) for s in sums])  # one device in practice: no copies, one read
    return {name: [str(t.dtype), list(t.shape), *v, buffer]
            for (name, t, buffer), v in zip(named, sums.cpu().tolist())}


def flip_bit(t: torch.Tensor) -> None:
    """Flip the lowest bit of a tensor's first element in place (a test hook: memory corrupted after a load)."""
    t.data.view(-1)[:1].view(_BITS[t.element_size()]).bitwise_xor_(1)
