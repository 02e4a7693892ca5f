"""vocab_parallel_logprobs against a plain log_softmax: values, gradients, vocab padding, chunking, TP=2; and
vocab_parallel_sum_squared_probs (the optimal token baseline's sum of p^2) against a plain softmax."""

import pytest
import torch
from megatron.core import parallel_state

from megarl.engine import logprobs as logprobs_module
from megarl.engine.logprobs import vocab_parallel_logprobs, vocab_parallel_sum_squared_probs
from megarl.utils.compiled import Compiled
from tests.dist_utils import run_distributed

LOCAL = 12  # padded vocab 24 = TP 2 x 12


def _inputs(dtype=torch.float64, vocab_size=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(2, 7, 2 * LOCAL, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, vocab_size, (2, 7), generator=g)
    weights = torch.randn(2, 2, 7, generator=g, dtype=torch.float64)  # the loss mixes log p and H
    return logits, targets, weights


def _reference(logits, targets, vocab_size, weights):
    """log p(target), H and d(loss)/d logits by autograd on log_softmax over the real vocabulary, float64."""
    logits = logits.detach().double().requires_grad_()
    log_p = torch.log_softmax(logits[..., :vocab_size], -1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), logits.grad


def _run(logits, targets, vocab_size, weights, entropy_grad=True):
    logits = logits.detach().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, vocab_size, True, entropy_grad)
    loss = (weights[0] * logprobs).sum() + ((weights[1] * entropy).sum() if entropy_grad else 0)
    loss.backward()
    return logprobs, entropy, logits.grad


@pytest.fixture
def tp1(monkeypatch):
    """One TP rank, without a process group (the function communicates only for TP > 1)."""
    parallel_state.set_tensor_model_parallel_rank(0)
    parallel_state.set_tensor_model_parallel_world_size(1)
    yield
    parallel_state.set_tensor_model_parallel_rank(None)
    parallel_state.set_tensor_model_parallel_world_size(None)


@pytest.mark.parametrize("chunk", [5 * 2 * LOCAL, 2 ** 27])  # 5-token chunks over 14 tokens; one chunk
def test_float64_matches_log_softmax_with_padding_and_chunks(tp1, monkeypatch, chunk):
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", chunk)
    logits, targets, weights = _inputs()
    ref_logprobs, ref_entropy, ref_grad = _reference(logits, targets, 21, weights)
    logprobs, entropy, grad = _run(logits, targets, 21, weights)
    assert logprobs.dtype == entropy.dtype == grad.dtype == torch.float64
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert torch.all(grad[..., 21:] == 0)  # padding columns
    squares = (torch.softmax(logits[..., :21], -1) ** 2).sum(-1).float()
    torch.testing.assert_close(vocab_parallel_sum_squared_probs(logits, 21), squares, rtol=0, atol=1e-7)

    small = logits[:1, :3, :8].detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, targets[:1, :3] % 6, 6, True), (small,))


def test_float32_and_entropy_as_metric(tp1, monkeypatch):
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 3 * 2 * LOCAL)
    logits, targets, weights = _inputs(torch.float32)
    ref_logprobs, ref_entropy, ref_grad = _reference(logits, targets, 21, weights)
    logprobs, entropy, grad = _run(logits, targets, 21, weights)
    assert logprobs.dtype == entropy.dtype == grad.dtype == torch.float32
    torch.testing.assert_close(logprobs, ref_logprobs.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=0, atol=1e-5)

    # entropy_grad=False: the entropy is a value without gradient; the log-prob gradient is unchanged.
    ref_grad = _reference(logits, targets, 21, torch.stack([weights[0], 0 * weights[1]]))[2]
    logprobs, entropy, grad = _run(logits, targets, 21, weights, entropy_grad=False)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, ref_entropy.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=0, atol=1e-5)
    assert vocab_parallel_logprobs(logits, targets, 21, with_entropy=False)[1] is None


def test_bf16_logits_get_a_bf16_gradient(tp1, monkeypatch):
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 4 * 2 * LOCAL)
    logits, targets, weights = _inputs(torch.bfloat16)
    ref_logprobs, ref_entropy, ref_grad = _reference(logits, targets, 21, weights)
    logprobs, entropy, grad = _run(logits, targets, 21, weights)
    assert logprobs.dtype == entropy.dtype == torch.float32 and grad.dtype == torch.bfloat16
    # The values are exact functions of the bf16 inputs, computed in float32.
    torch.testing.assert_close(logprobs, ref_logprobs.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy.float(), rtol=0, atol=2e-5)
    # The gradient is the float64 one rounded to bf16 (up to one bf16 step).
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2 ** -7, atol=1e-6)


def _tp2_rank(rank, chunk):
    logprobs_module.CHUNK_ELEMENTS = chunk  # a spawned process of its own: nothing to restore
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    # vocab 21: rank 1 holds 9 real columns and 3 padding; vocab 10: rank 1's slice is all padding.
    for vocab_size in (21, 10):
        logits, targets, weights = _inputs(vocab_size=vocab_size, seed=vocab_size)
        ref_logprobs, ref_entropy, ref_grad = _reference(logits, targets, vocab_size, weights)
        own = slice(tp_rank * LOCAL, (tp_rank + 1) * LOCAL)
        logprobs, entropy, grad = _run(logits[..., own], targets, vocab_size, weights)
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-12)
        torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad[..., own], rtol=0, atol=1e-12)
        squares = (torch.softmax(logits[..., :vocab_size], -1) ** 2).sum(-1).float()
        torch.testing.assert_close(vocab_parallel_sum_squared_probs(logits[..., own], vocab_size), squares, rtol=0,
                                   atol=1e-7)


def test_tp2_over_gloo_equals_the_whole_vocabulary():
    run_distributed(_tp2_rank, 2, 5 * LOCAL, tp=2, timeout=120)


def test_compiled_chunk_kernels_match_log_softmax(tp1, monkeypatch):
    """The path the GPU takes (inductor-compiled chunk functions), here compiled for the CPU."""
    kernels = [Compiled(fn, on=("cpu",), dynamic=True)
               for fn in (logprobs_module._chunk_sums, logprobs_module._chunk_grad)]
    monkeypatch.setattr(logprobs_module, "_CHUNK_SUMS", kernels[0])
    monkeypatch.setattr(logprobs_module, "_CHUNK_GRAD", kernels[1])
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 4 * 2 * LOCAL)
    logits, targets, weights = _inputs(torch.bfloat16)
    ref_logprobs, ref_entropy, ref_grad = _reference(logits, targets, 21, weights)
    logprobs, entropy, grad = _run(logits, targets, 21, weights)
    assert all(k.compiled is not None and not k.failed for k in kernels)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs, ref_logprobs.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, ref_entropy.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2 ** -7, atol=1e-6)
