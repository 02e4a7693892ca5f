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

`ChecksumTable` accumulates the pieces of many tensors into one int32 table on their device, read back with one
host sync. On a GPU the pieces are queued and summed by one Triton launch per integer width over a table of
segments (contiguous runs of elements); a flush can also make copies of the pieces' memory in the same pass
(`flush(copies)`: a sender packing a bucket reads each weight once, for the copy and its checksum alike).
Elsewhere the sums are computed with torch ops in chunks.

Nothing on a flush waits for the GPU or allocates once the first sync is done: a launch's segment table goes to
the device through pinned buffers kept per device and reused (`_Staging`; a fresh pinned allocation, cudaHostAlloc,
can stall for milliseconds while the GPU is busy), and `fetch` queues the read-back into a pinned buffer that
`values` waits for.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Iterable

import numpy as np
import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # integer views by element size (8: two int32 words)
MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)
_CHUNK = 1 << 24  # torch path: elements per chunk (a few int64 copies of it in temporary memory)
# Triton launch shape (elements per loop iteration of a program, iterations per program, warps), by whether the
# launch also copies: each program sums BLOCK * ITERS elements, then makes one atomic add per sum. Measured on an H200
# over 7.6B bf16 elements (verify.sh KERNEL_SWEEP=1, 24 shapes): summing alone 3.8 ms at (4096, 8, 8); copying and
# summing 8.6 ms at (4096, 16, 4) against 10.1 ms at (4096, 8, 8) and 7.2 ms for torch's copy alone.
_LAUNCH = {False: (4096, 8, 8), True: (4096, 16, 4)}
_ALIGN = 16  # bytes: the widest vector load; segments are read from 16-byte aligned addresses
_STAGING_MIN = 1 << 12  # int64 words of a staging buffer at least (32 KiB); grown by powers of two
_STAGING_SLOTS = 64  # staging buffers per device at most: past that a launch waits for the oldest one's to finish

try:  # Triton comes with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    @triton.jit
    def _weighted(x, index, s0, s1, m0, m1):
        """The two sums plus the block's bits x (sign-extended to 32 bits) at positions `index`."""
        x = x.to(tl.int32).to(tl.uint32, bitcast=True)
        return s0 + x * ((index * m0) | 1), s1 + x * ((index * m1) | 1)

    @triton.jit(do_not_specialize=["segments"])
    def _segment_sums_kernel(base, program_segment, meta, segments, out, M0: tl.constexpr, M1: tl.constexpr,
                             BLOCK: tl.constexpr, ITERS: tl.constexpr, VEC: tl.constexpr, COPY: tl.constexpr):
        """One program: BLOCK * ITERS elements of one segment. Addresses are element offsets from `base` (typed:
        the integer width of this launch), each segment's rounded down to a multiple of VEC elements (16 bytes),
        so the compiler can use vector loads; the `head` elements before the segment's own are masked off, as
        is what lies past its end, in a segment's first and last programs only. `meta` columns: source, head,
        end (head + length), position of the element at `source` (its first position - head, mod 2^32), table
        row, first program, destination (COPY: the segment's elements are also written there), copy flag."""
        pid = tl.program_id(0)
        segment = tl.load(program_segment + pid).to(tl.int64)
        source = tl.multiple_of(tl.load(meta + segment), VEC)
        head = tl.load(meta + segments + segment)
        end = tl.load(meta + 2 * segments + segment)
        position = tl.load(meta + 3 * segments + segment)
        row = tl.load(meta + 4 * segments + segment)
        start = (pid - tl.load(meta + 5 * segments + segment)) * (BLOCK * ITERS)
        first = (position + start).to(tl.uint32)  # positions mod 2^32: all the weights depend on
        m0 = tl.full([BLOCK], M0, tl.uint32)  # 32-bit constants: a plain literal would promote the products to 64 bits
        m1 = tl.full([BLOCK], M1, tl.uint32)
        s0 = tl.zeros([BLOCK], dtype=tl.uint32)
        s1 = tl.zeros([BLOCK], dtype=tl.uint32)
        src = base + source + start
        if COPY:
            dst = base + tl.multiple_of(tl.load(meta + 6 * segments + segment), VEC) + start
            copy = tl.load(meta + 7 * segments + segment) != 0
        if (start >= head) & (start + BLOCK * ITERS <= end):  # inside the segment: no masks, vector loads
            x = tl.load(src + tl.arange(0, BLOCK))
            for k in tl.static_range(ITERS):
                step = k * BLOCK + tl.arange(0, BLOCK)
                if k + 1 < ITERS:  # the next block's load goes out before this one's store (which it may alias)
                    following = tl.load(src + step + BLOCK)
                if COPY:
                    tl.store(dst + step, x, mask=copy)
                s0, s1 = _weighted(x, first + step.to(tl.uint32), s0, s1, m0, m1)
                if k + 1 < ITERS:
                    x = following
        else:
            for k in tl.static_range(ITERS):
                step = k * BLOCK + tl.arange(0, BLOCK)
                inside = (start + step >= head) & (start + step < end)
                x = tl.load(src + step, mask=inside, other=0)
                if COPY:
                    tl.store(dst + step, x, mask=inside & copy)
                s0, s1 = _weighted(x, first + step.to(tl.uint32), s0, s1, m0, m1)
        tl.atomic_add(out + 2 * row, tl.sum(s0, axis=0).to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_add(out + 2 * row + 1, tl.sum(s1, axis=0).to(tl.int32, bitcast=True), sem="relaxed")


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


def _width(t: torch.Tensor) -> int:
    """Bytes per integer word of t's bits (8-byte elements are two 4-byte words)."""
    return min(t.element_size(), 4)


class _Staging:
    """Segment tables of one device's launches on their way to it, without allocating or waiting in steady state:
    pinned host buffers and their device twins, reused in launch order once the launch that last read one has
    finished on the GPU (its event; `query` does not wait). While every buffer is still in use another is added
    (the first sync of a run, or more launches in flight than before), up to _STAGING_SLOTS; buffers grow (by
    powers of two) only when a launch needs more than the one it gets holds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: deque[list] = deque()  # [host buffer, device buffer, event of the last launch that read them]
        self.lock = threading.Lock()  # a flush in another thread must not take the slot being written
        self.allocations = 0  # buffers allocated so far (tests: none after the first sync)

    @contextlib.contextmanager
    def stage(self, meta: np.ndarray, programs: np.ndarray):
        """Yields (meta as int64 [n], programs as int32 [p]) on the device: views of one buffer, both starting at
        16-byte aligned addresses (as a fresh allocation does: Triton specialises on pointer alignment, so it
        compiles nothing new), copied there without a host sync. The launch that reads them goes inside the
        block; its completion is recorded on leaving it."""
        head = meta.size + meta.size % 2  # int64 words before the programs, an even count: 16-byte aligned
        words = head + -(-programs.size // 2)
        with self.lock:
            slot = self._free_slot()
            if slot[0] is None or slot[0].numel() < words:
                slot[0], slot[1] = self._buffers(words)
            host, on_device = slot[0], slot[1]
            staged = host.numpy()
            staged[:meta.size] = meta.reshape(-1)
            staged[head:words].view(np.int32)[:programs.size] = programs
            on_device[:words].copy_(host[:words], non_blocking=True)
            yield on_device[:meta.size], on_device[head:words].view(torch.int32)[:programs.size]
            if self.device.type == "cuda":
                if slot[2] is None:
                    slot[2] = torch.cuda.Event()
                slot[2].record(torch.cuda.current_stream(self.device))
            self.slots.append(slot)

    def _free_slot(self) -> list:
        """The oldest slot if its last launch is done, else a new one (the oldest's wait: at the limit only)."""
        if self.slots:
            event = self.slots[0][2]
            if event is None or event.query() or len(self.slots) >= _STAGING_SLOTS:
                if event is not None:
                    event.synchronize()  # done already, but at the limit
                return self.slots.popleft()
        return [None, None, None]

    def _buffers(self, words: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = max(_STAGING_MIN, 1 << (words - 1).bit_length())
        self.allocations += 1
        return (torch.empty(size, dtype=torch.int64, pin_memory=self.device.type == "cuda"),
                torch.empty(size, dtype=torch.int64, device=self.device))


_STAGINGS: dict[torch.device, _Staging] = {}


def _staging(device: torch.device) -> _Staging:
    """The device's staging buffers (shared by every table: SGLang's checksums build a table per request)."""
    if device not in _STAGINGS:
        _STAGINGS[device] = _Staging(device)
    return _STAGINGS[device]


class ChecksumTable:
    """Checksums of `size` tensors, each accumulated from pieces (`add`) into its row of an int32 table on
    `device`; `values()` reads them all at once. On a GPU the pieces are queued and summed by one kernel launch
    per integer width (`flush`, which must run before a queued piece's memory is reused: push_policy flushes
    each bucket); elsewhere each piece is summed when added. `reset` zeroes it for the next sync (a sender keeps
    one table across syncs: its pinned read-back buffer is allocated once)."""

    def __init__(self, size: int, device: torch.device | str):
        self.table = torch.zeros(size, len(MULTIPLIERS), dtype=torch.int32, device=device)
        # integer width -> runs of elements: [(address, rows, words per row, bytes from row to row, table row,
        # position of the first word, positions from row to row, the tensor: alive until launched)]
        self.queued: dict[int, list[tuple]] = {}
        self.host: torch.Tensor | None = None  # pinned: where `fetch` copies the table
        self.fetched: torch.cuda.Event | None = None  # that copy's completion; None: no copy of the current sums

    def reset(self) -> None:
        """Zero every sum (queued on the device, no host sync) and drop what is queued."""
        self.table.zero_()
        self.queued, self.fetched = {}, None

    def add(self, row: int, t: torch.Tensor, offset: int = 0, target_stride: int | None = None) -> None:
        """Add `t` placed in tensor `row`: its element (r, c) (row-major over t viewed as 2-D, 1-D tensors one row)
        sits at flat position offset + r * target_stride + c of that tensor (target_stride: the tensor's row
        length; default t's own, so a contiguous piece at `offset`)."""
        if t.numel() == 0:
            return
        if triton is None or not t.is_cuda:
            bits, words = _as_rows(t)
            stride = bits.shape[1] if target_stride is None else target_stride * words
            self.table[row] += _torch_sums(bits, offset * words, stride).to(self.table.device)
            self.fetched = None
            return
        words = 2 if t.element_size() == 8 else 1
        cols = t.shape[-1] if t.dim() else 1
        if t.is_contiguous() and (target_stride is None or target_stride == cols or t.numel() == cols):
            run = (t.data_ptr(), 1, t.numel() * words, 0, row, offset * words, 0, t)  # the common case: one run
        else:
            bits, words = _as_rows(t)
            rows, cols = bits.shape
            stride = cols if target_stride is None else target_stride * words
            run = (bits.data_ptr(), rows, cols, bits.stride(0) * bits.element_size(), row, offset * words, stride, bits)
        self.queued.setdefault(_width(t), []).append(run)

    def flush(self, copies: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Launch the sums of every queued piece (no host sync), and copy each (source, destination) of `copies`
        (contiguous tensors of one shape and dtype). A copy whose source the queued pieces tile is made by the
        kernel that sums them, in the same pass over the source; any other by torch."""
        left = list(copies)
        if self.queued:
            self.fetched = None
        for width, runs in self.queued.items():
            fusable = [(i, s, d) for i, (s, d) in enumerate(left) if _width(s) == width and d.is_cuda]
            fused = self._launch(width, runs, fusable)
            left = [c for i, c in enumerate(left) if i not in fused]
        self.queued = {}
        for source, destination in left:
            destination.copy_(source)

    def _launch(self, width: int, runs: list[tuple], copies: list[tuple[int, torch.Tensor, torch.Tensor]]) -> set[int]:
        """One kernel launch over the runs of one integer width; returns the indices of the copies it makes."""
        address, length, position, row = _segments(runs)
        destination, copy, fused = _fuse(address, length, width, copies)
        base = self.table.view(_BITS[width])  # addresses as element offsets from the table's (aligned) address
        vec = _ALIGN // width
        offsets, misaligned = np.divmod(address - base.data_ptr(), width)
        if misaligned.any():  # typed storage never is: a view of another width's storage at an odd offset
            raise ValueError(f"checksum pieces of {width}-byte words at addresses that are not multiples of {width}")
        head = offsets % vec
        block, iters, warps = _LAUNCH[bool(fused)]
        per = block * iters
        programs = -(-(head + length) // per)
        first_program = np.concatenate([[0], np.cumsum(programs)[:-1]])
        columns = [offsets - head, head, head + length, position - head, row, first_program]
        if fused:
            columns += [np.where(copy, (destination - base.data_ptr()) // width - head, 0), copy]
        meta = np.stack(columns).astype(np.int64)
        program_segment = np.repeat(np.arange(len(length), dtype=np.int32), programs)
        with _staging(self.table.device).stage(meta, program_segment) as (meta, program_segment):
            _segment_sums_kernel[(len(program_segment),)](
                base, program_segment, meta, len(length), self.table, M0=MULTIPLIERS[0], M1=MULTIPLIERS[1],
                BLOCK=block, ITERS=iters, VEC=vec, COPY=bool(fused), num_warps=warps)
        return fused

    def fetch(self) -> None:
        """Queue the sums' copy to the host (a pinned buffer of this table's, non-blocking) after everything queued:
        `values` then waits for that copy only. Elsewhere than on a GPU there is nothing to queue."""
        self.flush()
        if not self.table.is_cuda:
            return
        if self.host is None:
            self.host = torch.empty(self.table.shape, dtype=self.table.dtype, pin_memory=True)
        self.host.copy_(self.table, non_blocking=True)
        self.fetched = torch.cuda.Event()
        self.fetched.record(torch.cuda.current_stream(self.table.device))

    def values(self) -> list[list[int]]:
        """Each tensor's sums as non-negative ints below 2^32: the copy `fetch` queued once it is done, else read
        now (one host sync)."""
        self.flush()
        if self.fetched is not None:
            self.fetched.synchronize()
            host = self.host
        else:
            host = self.table.cpu()
        return (host.to(torch.int64) & 0xFFFFFFFF).tolist()


def _segments(runs: list[tuple]) -> tuple[np.ndarray, ...]:
    """Address, length (words), first position and table row of every contiguous segment of the queued runs."""
    single = [r for r in runs if r[1] == 1]
    address = [r[0] for r in single]
    length = [r[2] for r in single]
    position = [r[5] for r in single]
    row = [r[4] for r in single]
    parts = [tuple(np.asarray(c, dtype=np.int64) for c in (address, length, position, row))]
    for a, rows, cols, pitch, table_row, first, stride, _ in (r for r in runs if r[1] > 1):
        r = np.arange(rows, dtype=np.int64)
        parts.append((a + r * pitch, np.full(rows, cols, np.int64), first + r * stride,
                      np.full(rows, table_row, np.int64)))
    return tuple(np.concatenate(column) for column in zip(*parts))


def _fuse(address: np.ndarray, length: np.ndarray, width: int,
          copies: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray, set[int]]:
    """Which segments also copy their words (the copy flag and destination address per segment), and which
    copies that makes whole. A copy is fused when the segments inside its source tile it exactly (a segment
    repeated, such as a tensor every TP rank holds whole, counts once) and each segment's source and
    destination have the same alignment (16 bytes); its segments then write it."""
    n = len(address)
    destination, copy = np.zeros(n, np.int64), np.zeros(n, bool)
    ok = [(i, s, d) for i, s, d in copies if s.is_contiguous() and d.is_contiguous() and s.shape == d.shape
          and s.dtype == d.dtype]
    if not ok or n == 0:
        return destination, copy, set()
    src = np.array([s.data_ptr() for _, s, _ in ok], np.int64)
    order = np.argsort(src)
    src = src[order]
    size = np.array([s.numel() * s.element_size() for _, s, _ in ok], np.int64)[order]
    dst = np.array([d.data_ptr() for _, _, d in ok], np.int64)[order]
    which = np.searchsorted(src, address, side="right") - 1  # the copy whose source starts at or before
    inside = (which >= 0) & (address + length * width <= src[which] + size[which])
    _, first = np.unique(np.stack([address, length], axis=1), axis=0, return_index=True)
    candidate = np.zeros(n, bool)
    candidate[first] = True
    candidate &= inside
    pick = np.flatnonzero(candidate)
    pick = pick[np.lexsort((address[pick], which[pick]))]  # by copy, then by address
    c, a = which[pick], address[pick]
    e = a + length[pick] * width
    target = dst[c] + (a - src[c])
    opens = np.r_[True, c[1:] != c[:-1]]
    closes = np.r_[c[1:] != c[:-1], True]
    bad = ((opens & (a != src[c])) | (closes & (e != src[c] + size[c])) | (~opens & (a != np.r_[0, e[:-1]]))
           | ((a - target) % _ALIGN != 0))
    whole = np.zeros(len(ok), bool)
    whole[c] = True
    whole[c[bad]] = False
    keep = whole[c]
    copy[pick[keep]] = True
    destination[pick[keep]] = target[keep]
    return destination, copy, {ok[order[k]][0] for k in np.flatnonzero(whole)}


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
        named += [(name, t, True) for name, t in persistent_buffers(list(model.named_modules()))]
    if not named:
        return {}
    table = ChecksumTable(len(named), named[0][1].device)
    for row, (_, t, _) in enumerate(named):
        table.add(row, t)
    return {name: [str(t.dtype), list(t.shape), *v, buffer] for (name, t, buffer), v in zip(named, table.values())}


def persistent_buffers(modules: list) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every persistent buffer of `modules` (a model's named_modules())."""
    return [(f"{prefix}.{name}" if prefix else name, t) for prefix, module in modules
            for name, t in module._buffers.items() if t is not None and name not in module._non_persistent_buffers_set]


def flip_bit(t: torch.Tensor) -> None:
    """Flip the lowest bit of a tensor's first element in place (a test hook: memory corrupted after a load); any
    strides (SGLang's w_kc is a transposed view)."""
    t.data.as_strided((1,), (1,)).view(torch.uint8)[:1].bitwise_xor_(1)
