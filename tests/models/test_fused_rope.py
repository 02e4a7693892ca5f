"""megarl's fused RoPE (the GPU's path: the function compiled by inductor, here for the CPU) against megatron's
unfused RoPE, values and gradients, with a partial rotary width; and which kernels with_fused_kernels turns on."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import TransformerConfig

from megarl.config import ActorConfig
from megarl.engine.options import with_fused_kernels
from megarl.models import fused_rope
from megarl.utils.compiled import Compiled


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(10, 2, 3, 8, generator=g, dtype=torch.float64).to(dtype)  # [s, b, heads, d]
    angles = torch.rand(10, 2, 1, 3, generator=g, dtype=torch.float64) * 10  # per row's own positions
    freqs = torch.cat((angles, angles), -1).float()  # megatron's table: the frequencies twice; r = 6 < d = 8
    upstream = torch.randn(10, 2, 3, 8, generator=g, dtype=torch.float64).to(dtype)
    return t, freqs, upstream


def _grad(fn, t, freqs, upstream):
    t = t.detach().requires_grad_()
    out = fn(t, freqs)
    out.backward(upstream)
    return out.detach(), t.grad


def test_compiled_rope_matches_megatrons_unfused(monkeypatch):
    kernel = Compiled(fused_rope._rotate, on=("cpu",), dynamic=True)
    monkeypatch.setattr(fused_rope, "_ROTATE", kernel)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        t, freqs, upstream = _inputs(dtype)
        reference = _grad(rope_utils._apply_rotary_pos_emb_bshd, t, freqs, upstream)
        fused = _grad(fused_rope.fused_apply_rotary_pos_emb, t, freqs, upstream)
        assert kernel.compiled is not None and not kernel.failed
        for ours, theirs in zip(fused, reference):
            assert ours.dtype == dtype
            torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
        assert torch.equal(fused[0][..., 6:], t[..., 6:])  # the channels past the rotary width pass through
    with pytest.raises(ValueError, match="interleaved"):
        fused_rope.fused_apply_rotary_pos_emb(t, freqs, interleaved=True)


def _config(**kwargs):
    return TransformerConfig(**dict(num_layers=1, hidden_size=64, num_attention_heads=4, gated_linear_unit=True,
                                    activation_func=F.silu, add_bias_linear=False) | kwargs)


def test_fused_kernels_on_the_gpu_only_and_where_the_model_allows(monkeypatch):
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)  # no TransformerEngine
    on, off = ActorConfig(), ActorConfig(fused_kernels=False)

    def fusions(config, actor=on, device="cuda"):
        config = with_fused_kernels(config, actor, device)
        return config.bias_activation_fusion, config.apply_rope_fusion

    assert fusions(_config(), device="cpu") == fusions(_config(), off) == (False, False)
    assert fusions(_config()) == (True, True)
    assert rope_utils.fused_apply_rotary_pos_emb is fused_rope.fused_apply_rotary_pos_emb
    assert fusions(_config(mrope_section=[2, 1, 1])) == (True, False)  # Qwen2-VL: megatron's own M-RoPE
    assert fusions(_config(gated_linear_unit=False, activation_func=F.gelu)) == (False, True)
    assert fusions(_config(num_moe_experts=4, moe_router_topk=2)) == (False, True)  # experts: unfused SwiGLU
