"""The offload cycle of a bf16 engine with fp32 master weights (the GPU setting, here on CPU): only the fp32
master weights, Adam's states and the KL reference are copied to the host; gradient buffers and the bf16
weights are freed and re-made. Training through offload cycles must stay bit for bit the run without them,
and the host buffer is allocated once."""

import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch


def _batch(seed):
    batch = padded_batch(rows=4, seed=seed)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(seed))
    return batch


def _cycle_rank(rank, model_dir):
    from megarl.engine import MegatronEngine, offload

    def run(cycles: bool):
        e = MegatronEngine(model_dir, ActorConfig(precision="bf16", micro_batch_size=2, optim=OptimConfig(lr=1e-2)),
                           AlgorithmConfig(kl_coef=0.1), "cpu", 1, 10)
        e.snapshot_reference()
        reports, hosts = [], []
        for step in range(3):
            if cycles:
                resident = e.resident_bytes()
                reports.append((resident, e.offload(), e.resident_bytes()))
                e.onload()
                hosts.append(e._offloader.host.data_ptr())
            batch = _batch(step)
            batch.update(e.compute_logprobs(batch, reference=True))  # through the reference weights and back
            e.train(batch, loss="policy")
        weights = {n: t for bucket in e.export_hf_weights(1 << 30) for n, t in bucket}
        sizes = {"bf16": sum(p.numel() * 2 for p in e._parameters()),
                 "grads": sum(t.numel() * t.element_size() for m in e.models for t in offload.ddp_grad_buffers(m)),
                 "masters": len(offload.master_weight_pairs(e.optimizer))}
        return weights, reports, hosts, sizes, e.compute_logprobs(_batch(9))["logprobs"]

    return run(False), run(True)


def test_bf16_offload_copies_only_what_cannot_be_remade(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    (w_plain, _, _, _, lp_plain), (w_cycled, reports, hosts, sizes, lp_cycled) = run_distributed(_cycle_rank, 1,
                                                                                                model_dir)
    assert w_plain.keys() == w_cycled.keys() and all(torch.equal(w_plain[n], w_cycled[n]) for n in w_plain)
    assert torch.equal(lp_plain, lp_cycled)
    assert sizes["masters"] > 0 and sizes["grads"] == 2 * sizes["bf16"]  # fp32 grads of bf16 weights
    fp32_masters = 2 * sizes["bf16"]
    for step, (resident, moved, after) in enumerate(reports):
        assert after == 0 and moved["freed"] == resident
        # Adam's states (two moments and a 4-byte step count per tensor) exist from the first update on
        adam = 0 if step == 0 else 2 * fp32_masters + 4 * sizes["masters"]
        # copied: fp32 masters, Adam, the bf16 reference; not the bf16 weights (re-made) nor the grads (zeroed)
        assert moved["copied"] == fp32_masters + adam + sizes["bf16"], (step, moved, sizes)
        assert moved["freed"] - moved["copied"] == sizes["bf16"] + sizes["grads"]
    assert hosts[1] == hosts[2]  # grown once (Adam's states), then reused


def test_offload_falls_back_to_pageable_memory_when_pinning_fails(monkeypatch):
    """Pinned host memory ran out on a GPU host (4.4B policy beside SGLang): the offload goes on in pageable memory,
    with a warning."""
    from megarl.engine import offload

    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(offload.torch, "empty", empty)
    with pytest.warns(UserWarning, match="pinned host memory could not be allocated"):
        buffer = offload._host_buffer(64, pinned=True)
    assert buffer.numel() == 64 and not buffer.is_pinned()
