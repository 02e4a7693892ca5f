"""What a colocated training rank hands back of the allocator's cache around a weight sync: with the offload cycle,
all of it before the sync (SGLang maps its weights back next); without it, after the sync and only where the GPU
lacks SGLang's share (rollout.sglang_mem_fraction) outside the cache (SGLang's KV cache comes back next); an
emptied cache costs the next update its allocations afresh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.config.tiny import tiny_config
from megarl.workers.train_worker import TrainWorker

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
GB = 1 << 30


def events(monkeypatch, overrides: list[str], free_gb: float, total_gb: float = 100) -> list[str]:
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_mem_fraction=0.4", *overrides], path=QUICKSTART)
    worker, seen = TrainWorker(0, cfg, "unused", "cuda"), []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(free_gb * GB), int(total_gb * GB)))
    monkeypatch.setattr(worker, "_push_weights", lambda *args: seen.append("sync") or {})
    worker.push_weights(None, 1 << 20, verify=False)
    return seen


@pytest.mark.parametrize("free_gb, expected", [(60, ["sync"]), (39, ["sync", "empty_cache"])])
def test_without_the_offload_cycle_only_when_sglang_lacks_room(monkeypatch, free_gb, expected):
    assert events(monkeypatch, ["trainer.offload_between_phases=never"], free_gb) == expected


def test_with_the_offload_cycle_always_before_the_sync(monkeypatch):
    assert events(monkeypatch, ["trainer.offload_between_phases=auto"], free_gb=90) == ["empty_cache", "sync"]


def test_not_where_sglang_has_gpus_of_its_own_or_runs_asynchronously(monkeypatch):
    assert events(monkeypatch, ["rollout.sglang_gpus=1", "trainer.offload_between_phases=never"], 1) == ["sync"]
    assert events(monkeypatch, ["trainer.mode=async", "trainer.offload_between_phases=never"], 1) == ["sync"]
