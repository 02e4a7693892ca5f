"""A training rank that runs out of GPU memory says which settings make room, by their config keys, for the layout
it runs in (the 3B policy beside a colocated SGLang with the offload cycle off ran out in its update's backward on an
H200 and said only what PyTorch says)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.config.tiny import tiny_config
from megarl.workers.train_worker import TrainWorker

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
PYTORCH = "CUDA out of memory. Tried to allocate 5.80 GiB. GPU 0 has a total capacity of 139.80 GiB"


class OutOfMemoryEngine:
    def train(self, batch, loss, lr):
        raise torch.OutOfMemoryError(PYTORCH)

    def compute_logprobs(self, batch, **kwargs):
        raise torch.OutOfMemoryError(PYTORCH)


def message(overrides: list[str], call: str = "train") -> str:
    cfg = tiny_config(["rollout.engine=sglang", *overrides], path=QUICKSTART)
    worker = TrainWorker(0, cfg, "unused", "cuda")
    worker.engine = OutOfMemoryEngine()
    with pytest.raises(torch.OutOfMemoryError) as caught:
        worker.train(None) if call == "train" else worker.compute_logprobs(None)
    return str(caught.value)


def test_colocated_sglang_with_the_offload_cycle_off_names_it():
    text = message(["trainer.offload_between_phases=never", "actor.max_tokens_per_micro_batch=10240"])
    assert PYTORCH in text and "rank 0 (actor) ran out of GPU memory" in text
    assert "actor.max_tokens_per_micro_batch=10240" in text and "actor.recompute=full" in text
    assert "trainer.offload_between_phases=auto (now never" in text and "rollout.sglang_mem_fraction" in text


def test_only_what_applies_is_offered():
    # the offload cycle on (auto, colocated on a GPU) and recompute already on: only smaller micro-batches remain
    text = message(["actor.recompute=full"], call="logprobs")
    assert "max_tokens_per_micro_batch" in text
    assert "recompute" not in text and "offload_between_phases" not in text and "sglang_mem_fraction" not in text
    # SGLang on GPUs of its own: nothing of SGLang's to move
    text = message(["rollout.sglang_gpus=1", "trainer.offload_between_phases=never"])
    assert "offload_between_phases" not in text and "sglang_mem_fraction" not in text
