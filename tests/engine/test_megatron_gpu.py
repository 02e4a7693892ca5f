"""The same engine on one GPU: NCCL, bf16 through Float16Module, varlen flash attention for packed rows
(run on the device machine)."""

import collections
import dataclasses
import socket

import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def one_gpu():
    """megarl's parallel state over this process alone, on its GPU (NCCL)."""
    from megarl.parallel.state import destroy_parallel, init_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_parallel(0, 1, "127.0.0.1", port, device="cuda")
    yield
    destroy_parallel()


def test_bf16_engine_on_one_gpu(one_gpu, tmp_path):
    from megarl.engine import MegatronEngine

    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=False)
    batch = padded_batch(rows=8)
    ref_logprobs, ref_entropy = hf_logprobs_entropy(model_dir, batch)
    actor = ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-2))
    engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cuda", 1, 10)
    assert engine.params_dtype == torch.bfloat16
    out = engine.compute_logprobs(batch, with_entropy=True)
    # bf16 weights and activations: agreement to bf16 precision, not bitwise.
    assert (out["logprobs"] - ref_logprobs).abs().max() < 0.1
    assert (out["entropy"] - ref_entropy).abs().max() < 0.1
    losses = [engine.train(batch, loss="sft")["loss"] for _ in range(3)]
    assert losses[2] < losses[0], losses
    exported = {n: t for bucket in engine.export_hf_weights(1 << 20) for n, t in bucket}
    assert all(t.dtype == torch.bfloat16 and t.is_cuda for t in exported.values())
    assert "lm_head.weight" in exported and exported["model.embed_tokens.weight"].shape == (101, 32)


def test_varlen_flash_attention_matches_masked_sdpa_on_packed_rows(one_gpu, tmp_path, monkeypatch):
    """Packed micro-batches: aten's flash attention over cu_seqlens (what attention=auto picks on a GPU)
    gives masked SDPA's log-probs and, after one SFT step from the same weights, its loss and grad norm; so does
    actor.packing=one_row (one row per micro-batch, trimmed, the LM head at real positions only), also with its
    automatic width (no token budget, the defaults: 2 x 12 tokens)."""
    from megarl.engine import MegatronEngine, attention

    assert attention.resolve_core_attention("auto", "cuda") == "varlen", "no flash attention over cu_seqlens"
    calls = []
    flash = attention.flash_varlen
    monkeypatch.setattr(attention, "flash_varlen", lambda *args: calls.append(1) or flash(*args))
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=False, layers=4)
    batch = padded_batch(rows=8)
    results = {}
    for name, packing, max_tokens in (("sdpa", "rows", 24), ("varlen", "rows", 24), ("varlen", "one_row", 24),
                                      ("varlen", "one_row", 0)):
        actor = ActorConfig(micro_batch_size=2, max_tokens_per_micro_batch=max_tokens, attention=name,
                            packing=packing, optim=OptimConfig(lr=1e-3))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cuda", 1, 10)
        out = engine.compute_logprobs(batch, with_entropy=True)
        results[name, packing, max_tokens] = out, engine.train(batch, loss="sft")
        del engine
    assert calls, "the varlen kernel was never called"
    masked, masked_step = results.pop(("sdpa", "rows", 24))
    for varlen, varlen_step in results.values():
        # the same bf16 model; the kernels round differently (bf16 tolerance, as against transformers above)
        assert (masked["logprobs"] - varlen["logprobs"]).abs().max() < 0.1
        assert (masked["entropy"] - varlen["entropy"]).abs().max() < 0.1
        assert abs(masked_step["loss"] - varlen_step["loss"]) < 0.02 * abs(masked_step["loss"])
        assert abs(masked_step["grad_norm"] - varlen_step["grad_norm"]) < 0.05 * masked_step["grad_norm"]


def test_fused_kernels_match_megatrons_unfused_ops(one_gpu, tmp_path, monkeypatch):
    """actor.fused_kernels (the GPU default: SwiGLU and RoPE as one Triton kernel each way) computes what the
    unfused ops compute: in float32 (bf16 rounds each path differently, by as much as the paths differ from
    transformers) the log-probs, the entropy and one policy step's loss and grad norm agree to float32 rounding."""
    from megarl.engine import MegatronEngine
    from megarl.models import fused_ops, kernels

    assert fused_ops.available("cuda")  # probed (and cached) before the kernels' calls are counted
    calls = collections.Counter()
    for name in ("rope", "swiglu"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, name=name, kernel=kernel: calls.update([name]) or kernel(*a))
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=False, layers=4)
    batch = padded_batch(rows=8)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for fused in (False, True):
        actor = ActorConfig(micro_batch_size=2, precision="fp32", attention="sdpa",  # flash: 16-bit only
                            fused_kernels=fused, optim=OptimConfig(lr=1e-3))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cuda", 1, 10)
        config = engine.gpt.config
        assert config.bias_activation_fusion == config.apply_rope_fusion == config.gradient_accumulation_fusion == fused
        results[fused] = engine.compute_logprobs(batch, with_entropy=True), engine.train(batch, loss="policy")
        del engine
    assert calls["rope"] == calls["swiglu"] * 2 > 0  # megarl's Triton kernels: queries and keys, each MLP
    (plain, plain_step), (fused, fused_step) = results[False], results[True]
    assert (plain["logprobs"] - fused["logprobs"]).abs().max() < 1e-4
    assert (plain["entropy"] - fused["entropy"]).abs().max() < 1e-4
    assert abs(plain_step["loss"] - fused_step["loss"]) < 1e-4 * abs(plain_step["loss"]) + 1e-6
    assert abs(plain_step["grad_norm"] - fused_step["grad_norm"]) < 1e-4 * plain_step["grad_norm"]


def test_gradient_accumulation_fusion_in_bf16_matches_megatrons_unfused_path(one_gpu, tmp_path, monkeypatch):
    """In bf16 (the GPU default) the weight gradients' GEMMs add into the float32 main_grad themselves (torch's
    addmm with out_dtype=float32, engine/apex_ops.py): the same loss, and the grad norm to bf16 rounding (the
    unfused path rounds each micro-batch's weight gradient to bf16 before adding it; the fused one never does)."""
    from megarl.engine import MegatronEngine, apex_ops, megatron_engine

    assert apex_ops.wgrad_fusion_available("cuda", torch.bfloat16), \
        "this torch's addmm(out_dtype=float32) does not accumulate bf16 products into a float32 matrix"
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True, layers=4)
    batch = padded_batch(rows=8)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(0))
    fused_kernels = megatron_engine.with_fused_kernels
    steps = {}
    for fused in (False, True):
        monkeypatch.setattr(megatron_engine, "with_fused_kernels", lambda config, actor, device: dataclasses.replace(
            fused_kernels(config, actor, device), gradient_accumulation_fusion=fused))
        engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-3)),
                                AlgorithmConfig(), "cuda", 1, 10)
        assert engine.params_dtype == torch.bfloat16 and engine.gpt.config.gradient_accumulation_fusion == fused
        steps[fused] = [engine.train(batch, loss="policy") for _ in range(2)]
        del engine
    for plain, fused in zip(steps[False], steps[True]):
        assert abs(plain["loss"] - fused["loss"]) < 0.01 * abs(plain["loss"]) + 1e-4
        assert abs(plain["grad_norm"] - fused["grad_norm"]) < 0.01 * plain["grad_norm"]


def test_flash_varlen_matches_per_segment_sdpa_with_gqa_and_a_narrower_value_head():
    """aten's flash kernels over cu_seqlens, called directly (flash_varlen), against one causal SDPA per segment:
    outputs and gradients, with grouped-query heads and multi-latent attention's narrower value head."""
    from megarl.engine.attention import flash_varlen, segment_sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 17, 18, 40], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(40, heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
               for heads, dim in ((4, 16), (2, 16), (2, 8)))
    upstream = torch.randn(40, 4, 8, generator=g, device="cuda", dtype=torch.bfloat16)
    results = []
    for kernel in (flash_varlen, segment_sdpa):
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = kernel(*inputs, cu_seqlens, 22, 0.3)
        out.backward(upstream)
        results.append([out.detach(), *(x.grad for x in inputs)])
    for flash, reference in zip(*results):
        assert flash.shape == reference.shape
        torch.testing.assert_close(flash.float(), reference.float(), rtol=0.02, atol=0.02)
