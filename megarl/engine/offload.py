"""Moving an engine's memory to host memory between phases, and back.

Works at the level of storages: each distinct storage behind the given tensors (a parameter, megatron
DDP's contiguous grad/param buffers, an optimizer state) is copied to host memory and resized to 0
bytes, which frees its device memory while every tensor and view on it (param.main_grad, the
optimizer's references) stays a valid object. Onload resizes each storage back and copies the bytes
in, so all views see exactly the values they had. The same code runs on CPU, where the host copy is
an ordinary second buffer (the storages are still released, which the tests check).
"""

from __future__ import annotations

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


class HostCopies:
    """The host copies of offloaded storages; `restore()` puts them back (once)."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        for storage in distinct_storages(tensors):
            if not storage.resizable():  # e.g. a numpy view of it was taken, or it was moved to shared memory
                raise RuntimeError(f"cannot offload a storage of {storage.nbytes()} bytes that is not resizable "
                                   "(a numpy view or shared memory): copy engine tensors before numpy() or sharing")
            pinned = storage.device.type == "cuda"  # pinned host memory makes the copies asynchronous
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.untyped_storage().copy_(storage, non_blocking=pinned)
            self.saved.append((storage, host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for storage, _ in self.saved:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.saved)

    def restore(self) -> None:
        for storage, host in self.saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=host.is_pinned())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.saved = []


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


def ddp_buffer_tensors(model) -> list[torch.Tensor]:
    """megatron DDP's contiguous grad (and, with the distributed optimizer, param) buffers."""
    buffers = getattr(model, "buffers", [])
    if callable(buffers):  # not a megatron DDP: nn.Module.buffers is a method, there are no grad buffers
        return []
    buffers = list(buffers) + list(getattr(model, "expert_parallel_buffers", []))
    return [t for b in buffers for t in (b.grad_data, b.param_data) if t is not None]
