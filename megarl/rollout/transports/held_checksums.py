"""Inside an SGLang TP worker (megarl's persistent loader, cuda_ipc.load_flat_bucket): the checksums of what this
rank holds after a verified sync, computed while the sync is still loading and collected after it.

Every bucket of a verified sync (full delivery) names the parameters (and derived tensors, such as DeepSeek's
w_kc/w_vc, which SGLang derives at the end of the load that carried their kv_b_proj) whose last piece it carried:
the sender counts them down from its weight layout (weight_layout.ExpectedChecksums.completed). Once a bucket's load
is queued, those are summed from SGLang's own memory on a side stream behind the load's copies, and the loader
returns without waiting for them. The last bucket (or, for sharded delivery, a request after it) queues the sums of
everything else held that the sync did not name (persistent buffers; a parameter no bucket named, which the
comparison reports as never sent) and the table's copy to the host, records an event, and returns without waiting
(`finish`): the sums run while the trainer goes on (SGLang generates from the weights, which generation only reads).
A later request (the rollout engine's weight_checksums, before the trainer trains on anything those weights
generated) waits for the event and writes the file (`collect`). The result is what
megarl.utils.checksum.module_checksums gives after the last load, of the same memory.

A parameter summed once its bucket is loaded is not summed again: a later load writing into it (a layout that
does not know SGLang writes it from another tensor) would go unseen by this sync's checksums. Sums still pending
when a load or a bit flip (the test hook standing for corrupted memory) begins are dropped (`drop`, ordered before
the write): the next collection then checksums everything held, as it is then (cuda_ipc.inspect_weights).
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

from megarl.rollout.weight_layout import DERIVED_ATTRIBUTES
from megarl.utils.checksum import ChecksumTable, persistent_buffers

# Benchmarks set this in a server's environment: each load then prints its seconds to the server's log
# (cuda_ipc.LOAD_TIMING lines), and a verification's collection the GPU time of the sync's sums (CUDA events
# around each batch of them on the side stream: the time they ran, sharing the GPU with whatever else ran).
TIME_LOADS = os.environ.get("MEGARL_TIME_WEIGHT_LOADS") == "1"


def derived_tensors(model, modules: list | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor attribute named in weight_layout.DERIVED_ATTRIBUTES (SGLang's MLA w_kc and
    w_vc, which post_load_weights derives from kv_b_proj) that a module of `model` (or of `modules`, its
    named_modules) holds beside its parameters and buffers: verification checks them as parameters."""
    if modules is None:
        modules = list(model.named_modules()) if isinstance(model, torch.nn.Module) else []
    found = []
    for prefix, module in modules:
        for attribute in DERIVED_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if isinstance(value, torch.Tensor):
                found.append((f"{prefix}.{attribute}" if prefix else attribute, value))
    return found


class HeldChecksums:
    """One TP worker's checksums of a verified sync in progress (one per model, kept across syncs: its table, rows
    and side stream are made once). `loaded` after each bucket's load is queued, `finish` after the last, `collect`
    by a later request."""

    def __init__(self, model):
        # where derived tensors and buffers live (modules stay; a load may put a new tensor in one)
        self.modules = list(model.named_modules()) if isinstance(model, torch.nn.Module) else []
        self.rows: dict[str, int] = {}
        self.table: ChecksumTable | None = None
        self.stream = None  # a GPU's side stream: the sums queue behind the loads, the loader does not wait
        self.sync: str | None = None  # the sync being summed
        self.summed: dict[str, tuple[str, list, bool]] = {}  # name -> (dtype, shape, is a buffer), this sync
        self.held: dict[str, torch.Tensor] | None = None  # what the last bucket's `loaded` found, for `finish`
        self.pending: dict[str, tuple[str, list, bool]] | None = None  # a finished sync's sums, not yet collected
        self.timed: list[tuple] = []  # TIME_LOADS: (start, end) CUDA events around each batch of sums, this sync
        self.gpu_s = 0.0  # TIME_LOADS: the collected sync's sums' GPU seconds

    def loaded(self, model, sync: str, names: list[str]) -> None:
        """A bucket of sync `sync` is loaded (its copies queued on the current stream): sum the tensors `names`,
        whole from now on (those this rank does not hold are left to the comparison, which names them missing)."""
        held = self.held = self._held(model)
        if sync != self.sync:
            self._begin(sync, held)
        with self._queued():
            for name in names:
                if name in held and name not in self.summed:
                    self._add(name, held[name], False)
            self.table.flush()

    def finish(self, model) -> int:
        """After the sync's last bucket (and its `loaded`, in the same request: what it found held is still so), or
        after a sync whose buckets named nothing (a sync of its own), queue the sums of everything held not summed
        yet and the table's copy to the host, and record when they are done; nothing waits here (`collect` does).
        Returns how many tensors the sums cover."""
        held, self.held = self.held if self.held is not None else self._held(model), None
        buffers = persistent_buffers(self.modules)
        if self.sync is None:  # a verified sync whose buckets named nothing
            self._begin("", held)
        with self._queued():
            for name, t in held.items():
                if name not in self.summed:
                    self._add(name, t, False)
            for name, t in buffers:
                if name not in self.summed and name not in held:
                    self._add(name, t, True)
            self.table.fetch()  # recorded on the side stream: `values` waits for these sums only
        self.pending, self.sync = self.summed, None
        return len(self.pending)

    def collect(self, path: str) -> int | None:
        """The sums `finish` queued, once done, as name -> [dtype, shape, sum 0, sum 1, is a buffer] in `path`
        (written atomically); returns how many, or None when none are pending (nothing asked for them since the
        last collection, or a write dropped them): the caller checksums what is held now instead."""
        if self.pending is None:
            return None
        values = self.table.values()  # waits for the side stream's sums and their copy, nothing else
        self.gpu_s = sum(start.elapsed_time(end) for start, end in self.timed) / 1e3
        out = {name: [dtype, shape, *values[self.rows[name]], buffer]
               for name, (dtype, shape, buffer) in self.pending.items()}
        self.pending = None
        from megarl.rollout.sglang_server import json_dumps  # orjson where SGLang is (here: an import cycle)

        staging = path + ".tmp"
        with open(staging, "wb") as f:
            f.write(json_dumps(out))
        os.replace(staging, path)
        return len(out)

    def drop(self) -> None:
        """Before a write into the weights (a load, a flipped bit): the pending sums no longer stand for what is
        held, so they go; on a GPU the write is ordered after them (they read the memory it writes)."""
        if self.pending is None:  # a sync's own loads do not wait for its sums of earlier buckets
            return
        self.pending = None
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def _held(self, model) -> dict[str, torch.Tensor]:
        """The parameters and derived tensors as the model holds them now (a load may have replaced a tensor)."""
        return dict(model.named_parameters()) | dict(derived_tensors(model, self.modules))

    def _begin(self, sync: str, held: dict) -> None:
        for name in [*held, *(name for name, _ in persistent_buffers(self.modules))]:
            self.rows.setdefault(name, len(self.rows))
        device = next(iter(held.values())).device if held else torch.device("cpu")
        with self._queued(device):
            if self.table is None or self.table.table.shape[0] < len(self.rows) or self.table.table.device != device:
                self.table = ChecksumTable(len(self.rows), device)
            else:
                self.table.reset()
        self.sync, self.summed, self.timed = sync, {}, []

    def _add(self, name: str, t: torch.Tensor, buffer: bool) -> None:
        if name not in self.rows:  # appeared since the sync began (a derived tensor's first derivation): a new row
            self.rows[name] = len(self.rows)
            if len(self.rows) > self.table.table.shape[0]:  # twice the rows: few such copies
                grown = ChecksumTable(2 * len(self.rows), self.table.table.device)
                self.table.flush()
                grown.table[:self.table.table.shape[0]].copy_(self.table.table)
                self.table = grown
        if self.stream is not None and not isinstance(t, torch.nn.Parameter):
            t.record_stream(self.stream)  # a derived tensor a later load replaces stays allocated until summed
        self.table.add(self.rows[name], t)
        self.summed[name] = (str(t.dtype), list(t.shape), buffer)

    @contextlib.contextmanager
    def _queued(self, device: torch.device | None = None):
        """On a GPU: on the side stream, behind everything queued on the current stream so far (the load)."""
        device = device or (self.table.table.device if self.table is not None else torch.device("cpu"))
        if device.type != "cuda":
            yield
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            if TIME_LOADS:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            yield
            if TIME_LOADS:
                end.record()
                self.timed.append((start, end))


_STATES: "weakref.WeakKeyDictionary[object, HeldChecksums]" = weakref.WeakKeyDictionary()


def held_checksums(model) -> HeldChecksums:
    """The model's HeldChecksums (one per model of this process: an SGLang TP worker holds one)."""
    if model not in _STATES:
        _STATES[model] = HeldChecksums(model)
    return _STATES[model]
