"""megarl's Triton kernels for RoPE and SwiGLU (the GPU's path; without a GPU under Triton's interpreter, which
tests/conftest.py turns on) against megatron's unfused ops, values and gradients, through the hooks megatron calls;
and which kernels with_fused_kernels turns on."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import TransformerConfig, mlp

from megarl.config import ActorConfig
from megarl.engine.options import with_fused_kernels
from megarl.models import fused_ops, kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grad(fn, x, upstream, *args):
    x = x.detach().requires_grad_()
    out = fn(x, *args)
    out.backward(upstream)
    return out.detach(), x.grad


def _rope_inputs(dtype, rows_own_angles: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as megatron makes it: a view of heads 1..3 of a wider projection (strided heads), [s, b, heads, d]
    qkv = torch.randn(10, 2, 5, 8, generator=g, dtype=torch.float64).to(dtype)
    angles = torch.rand(10, 2 if rows_own_angles else 1, 1, 3, generator=g, dtype=torch.float64) * 10
    freqs = torch.cat((angles, angles), -1).float()  # megatron's table: the frequencies twice; r = 6 < d = 8
    upstream = torch.randn(10, 2, 3, 8, generator=g, dtype=torch.float64).to(dtype)
    return qkv[:, :, 1:4], freqs, upstream


@pytest.mark.parametrize("rows_own_angles", [True, False])
def test_rope_kernel_matches_megatrons_unfused(rows_own_angles):
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        t, freqs, upstream = (x.to(DEVICE) for x in _rope_inputs(dtype, rows_own_angles))
        reference = _grad(rope_utils._apply_rotary_pos_emb_bshd, t, upstream, freqs)
        fused = _grad(fused_ops.fused_apply_rotary_pos_emb, t, upstream, freqs)
        for ours, theirs in zip(fused, reference):
            assert ours.dtype == dtype
            torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
        assert torch.equal(fused[0][..., 6:], t[..., 6:])  # the channels past the rotary width pass through
        assert torch.equal(fused[1][..., 6:], upstream[..., 6:])
    with pytest.raises(ValueError, match="interleaved"):
        fused_ops.fused_apply_rotary_pos_emb(t, freqs, interleaved=True)
    with pytest.raises(ValueError, match="even r <= d"):
        kernels.rope(t, freqs[..., :5])


def test_swiglu_kernel_matches_megatrons_through_the_mlp_hook(monkeypatch):
    monkeypatch.setattr(mlp, "bias_swiglu_impl", mlp.bias_swiglu_impl)  # install() replaces it: undone after
    fused_ops.install()
    assert mlp.bias_swiglu_impl is fused_ops.fused_swiglu
    g = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):  # bf16: within ~2 of its steps
        y = (torch.randn(6, 2, 2 * 40, generator=g, dtype=torch.float64) * 3).to(dtype).to(DEVICE)  # [s, b, 2F]
        upstream = torch.randn(6, 2, 40, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
        out, grad = _grad(lambda x: mlp.bias_swiglu_impl(x, None), y, upstream)
        a, b = y.double().chunk(2, -1)  # megatron's swiglu and swiglu_back (fused_bias_swiglu), in float64
        expected = F.silu(a) * b
        expected_grad = torch.cat((upstream * torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a))) * b,
                                   upstream * F.silu(a)), -1)
        assert out.shape == (6, 2, 40) and out.dtype == grad.dtype == dtype
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
        torch.testing.assert_close(grad.double(), expected_grad, rtol=tol, atol=tol)
    bias = torch.zeros(80, device=DEVICE)  # with a bias: megatron's own (models here have none)
    assert torch.equal(fused_ops.fused_swiglu(y.float(), bias), fused_bias_swiglu.bias_swiglu_impl(y.float(), bias))


def _config(**kwargs):
    return TransformerConfig(**dict(num_layers=1, hidden_size=64, num_attention_heads=4, gated_linear_unit=True,
                                    activation_func=F.silu, add_bias_linear=False) | kwargs)


def test_fused_kernels_on_the_gpu_only_and_where_the_model_allows(monkeypatch):
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)  # no TransformerEngine
    monkeypatch.setattr(fused_ops, "available", lambda device: True)  # "cuda" here is a name: no GPU is probed
    monkeypatch.setattr(mlp, "bias_swiglu_impl", fused_bias_swiglu.bias_swiglu_impl)
    on, off = ActorConfig(), ActorConfig(fused_kernels=False)

    def fusions(config, actor=on, device="cuda"):
        config = with_fused_kernels(config, actor, device)
        return config.bias_activation_fusion, config.apply_rope_fusion

    assert fusions(_config(), device="cpu") == fusions(_config(), off) == (False, False)
    assert mlp.bias_swiglu_impl is fused_bias_swiglu.bias_swiglu_impl  # nothing installed for the CPU
    assert fusions(_config()) == (True, True)
    assert rope_utils.fused_apply_rotary_pos_emb is fused_ops.fused_apply_rotary_pos_emb
    assert mlp.bias_swiglu_impl is fused_ops.fused_swiglu
    assert fusions(_config(mrope_section=[2, 1, 1])) == (True, False)  # Qwen2-VL: megatron's own M-RoPE
    assert fusions(_config(gated_linear_unit=False, activation_func=F.gelu)) == (False, True)
    assert fusions(_config(num_moe_experts=4, moe_router_topk=2)) == (False, True)  # experts: unfused SwiGLU


def test_kernels_that_do_not_build_leave_megatrons_unfused_ops(monkeypatch):
    """A GPU or container where Triton cannot build its kernels (no C compiler, an unsupported GPU) trains with
    megatron's unfused ops and says why, instead of failing at the first step."""
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(mlp, "bias_swiglu_impl", fused_bias_swiglu.bias_swiglu_impl)
    fused_ops.available.cache_clear()
    assert fused_ops.available(DEVICE)  # the real probe: the kernels build here (the interpreter without a GPU)

    def broken():
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kernels, "_triton", broken)
    fused_ops.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="do not run on .*Failed to find C compiler.*unfused ops stay"):
            assert not fused_ops.available(DEVICE)
        with warnings.catch_warnings():  # without a GPU the probe of "cuda" fails on its own, and says so
            warnings.simplefilter("ignore")
            config = with_fused_kernels(_config(), ActorConfig(), "cuda")
    finally:
        fused_ops.available.cache_clear()
    assert not config.bias_activation_fusion and not config.apply_rope_fusion
    assert config.gradient_accumulation_fusion  # not a Triton kernel: unaffected (float32 here)
    assert rope_utils.fused_apply_rotary_pos_emb is None and mlp.bias_swiglu_impl is fused_bias_swiglu.bias_swiglu_impl
