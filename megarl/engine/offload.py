"""Moving an engine's memory to host memory between phases, and back.

Works at the level of storages: each distinct storage behind the given tensors (a parameter, megatron
DDP's contiguous grad/param buffers, an optimizer state) is resized to 0 bytes, which frees its device
memory while every tensor and view on it (param.main_grad, the optimizer's references) stays a valid
object; onload resizes it back. Only what cannot be re-made is copied (`kept`): into one host buffer,
pinned on GPU and allocated once (grown when the state grows, e.g. by Adam's first step), by
asynchronous copies with one synchronisation per direction. The rest (`remade`) comes back with
undefined values: gradient buffers, which every update zeroes first, and bf16 weights that the engine
re-makes from the optimizer's fp32 master copies (`master_weight_pairs`). The same code runs on CPU,
where the host buffer is ordinary memory (the storages are still released, which the tests check).
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen, storages = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        storages.append(storage)
    return storages


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (copies in and out of it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Offloader:
    """One engine's offload cycle; `offload(kept, remade)` then `onload()`, as often as needed."""

    def __init__(self):
        self.host: torch.Tensor | None = None  # reused across cycles
        self.kept: list[tuple[torch.UntypedStorage, int, int]] = []  # (storage, offset in host, bytes)
        self.remade: list[tuple[torch.UntypedStorage, int]] = []  # (storage, bytes)
        self.active = False

    def offload(self, kept: Iterable[torch.Tensor], remade: Iterable[torch.Tensor]) -> dict[str, int]:
        """Free the storages behind `kept` (their bytes copied to the host) and `remade` (not copied; a storage
        also behind `kept` is kept). Returns {'copied': bytes copied to the host, 'freed': bytes freed}."""
        if self.active:
            raise RuntimeError("the engine is already offloaded")
        kept = distinct_storages(kept)
        held = {s.data_ptr() for s in kept}
        remade = [s for s in distinct_storages(remade) if s.data_ptr() not in held]
        for storage in kept + remade:
            if not storage.resizable():  # e.g. a numpy view of it was taken, or it was moved to shared memory
                raise RuntimeError(f"cannot offload a storage of {storage.nbytes()} bytes that is not resizable "
                                   "(a numpy view or shared memory): copy engine tensors before numpy() or sharing")
        total = sum(s.nbytes() for s in kept)
        if self.host is None or self.host.numel() < total:
            self.host = None  # the old buffer goes before the larger one is made
            pinned = any(s.device.type == "cuda" for s in kept)  # pinned host memory: asynchronous copies
            self.host = _host_buffer(total, pinned)
        offset = 0
        for storage in kept:
            n = storage.nbytes()
            self.host[offset:offset + n].copy_(_bytes(storage), non_blocking=self.host.is_pinned())
            self.kept.append((storage, offset, n))
            offset += n
        _synchronize()
        self.remade = [(s, s.nbytes()) for s in remade]
        for storage in kept + remade:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.active = True
        return {"copied": total, "freed": total + sum(n for _, n in self.remade)}

    def onload(self) -> None:
        """Every storage back at its size; the kept ones with exactly their bytes from before."""
        if not self.active:
            raise RuntimeError("the engine is not offloaded")
        for storage, n in self.remade:
            storage.resize_(n)
        for storage, offset, n in self.kept:
            storage.resize_(n)
            _bytes(storage).copy_(self.host[offset:offset + n], non_blocking=self.host.is_pinned())
        _synchronize()
        self.kept, self.remade, self.active = [], [], False


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes currently allocated behind the tensors (each storage counted once)."""
    return sum(s.nbytes() for s in distinct_storages(tensors))


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a megatron optimizer holds: its (fp32 main) params and Adam's states."""
    out = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        out += [p for group in inner.param_groups for p in group["params"]]
        out += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def master_weight_pairs(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(bf16/fp16 model weight, its fp32 master copy) of megatron's mixed-precision optimizer without the
    distributed optimizer (whose master copies are DP shards). After every update the weight is the master
    copy rounded, so it can be re-made from it instead of being kept."""
    pairs = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, main_group in zip(getattr(part, "float16_groups", []),
                                           getattr(part, "fp32_from_float16_groups", [])):
            pairs += list(zip(model_group, main_group))
    return pairs


def ddp_grad_buffers(model) -> list[torch.Tensor]:
    """megatron DDP's contiguous gradient buffers (zeroed before every backward)."""
    return [b.grad_data for b in _ddp_buffers(model) if b.grad_data is not None]


def ddp_param_buffers(model) -> list[torch.Tensor]:
    """megatron DDP's contiguous param buffers (with the distributed optimizer the params are views into them)."""
    return [b.param_data for b in _ddp_buffers(model) if b.param_data is not None]


def _ddp_buffers(model) -> list:
    buffers = getattr(model, "buffers", [])
    if callable(buffers):  # not a megatron DDP: nn.Module.buffers is a method, there are no grad buffers
        return []
    return list(buffers) + list(getattr(model, "expert_parallel_buffers", []))


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """The host copy of the offloaded state. Pinned memory can run out well before host memory does (measured:
    pinning 39 GB of a 4.4B policy's state failed on a 125 GiB host beside SGLang): then pageable memory,
    slower to copy to and from but enough, with a warning that says so."""
    if pinned:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:  # torch.AcceleratorError is one
            warnings.warn(f"offload: {nbytes / 1e9:.1f} GB of pinned host memory could not be allocated ({error}); "
                          "using pageable memory (slower offload and onload)")
    return torch.empty(nbytes, dtype=torch.uint8)
