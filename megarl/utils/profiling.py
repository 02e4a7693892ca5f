"""One stretch of work under torch.profiler, written to a directory: the ops by GPU time and by host time
(ops_by_device.txt, ops_by_host.txt) and the chrome trace (trace.json.gz, for chrome://tracing or Perfetto)."""

from __future__ import annotations

import contextlib
import gzip
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch


def synced_now(device: str) -> float:
    """perf_counter once the device's queued work is done (a GPU runs behind the host)."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def profiled(directory: Path | str | None, device: str) -> Iterator[dict]:
    """Profile the body into `directory` (nothing at all when it is None). The dict yielded gets, once the body is
    done, its wall seconds (`wall_s`; the GPU's own time is in ops_by_device.txt and the trace) and the profiler's
    per-op averages (`ops`, torch's key_averages) for a caller's own accounting."""
    summary: dict = {}
    if directory is None:
        yield summary
        return
    from torch.profiler import ProfilerActivity, profile

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = synced_now(device)
        yield summary
        summary["wall_s"] = synced_now(device) - start
    averages = summary["ops"] = prof.key_averages()
    for name, key in (("ops_by_device", "device_time_total"), ("ops_by_host", "self_cpu_time_total")):
        (out / f"{name}.txt").write_text(averages.table(sort_by=key, row_limit=50, max_name_column_width=70))
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
