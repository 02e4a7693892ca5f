"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary. Per token, a rank reduces its slice to
a max m_r, a sum of exponentials s_r = sum exp(x - m_r) and, for the entropy, b_r = sum exp(x - m_r)(x - m_r);
two all-reduces over the TP group (MAX of m_r, then SUM of the rescaled s_r, b_r and the owned target logit)
give log Z, log p(target) and the entropy H = log Z - E_p[x] on every rank.

Why a hand-written autograd.Function (measured with benchmarks/logprobs_speed.py): written as plain torch
ops, each elementwise step over [tokens, V_local] (float(), the padding mask, the shift, exp, exp * x)
materialises a float32 copy of the logits (6.2 GB at 10240 tokens x 151936), autograd keeps several of
them and replays as many passes in backward. Here the forward walks the tokens in chunks and keeps only
per-token float32 numbers (log Z, H) plus the input logits, which are needed anyway; the backward
recomputes p per chunk and writes the gradient straight into the logits' dtype:
    d log p(t) / d x_j = [j = t] - p_j,        d H / d x_j = -p_j (x_j - E_p[x]) = -p_j (log p_j + H).
Both use the global normaliser, so a rank's formula covers its own slice exactly, and the backward needs
no communication: every TP rank computes the same loss from the same (all-reduced) log-probs and entropy,
so each receives the full upstream gradient of both outputs and only its slice's share is left to it.
Vocab padding ids (>= vocab_size, at the end of the last rank's slice) are left out of every sum and get a
zero gradient. The per-chunk work is two small functions (_chunk_sums, _chunk_grad); on CUDA inductor fuses
each into one kernel over the bf16 chunk (no float32 copy at all), on the CPU they run eagerly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from megarl.utils.compiled import Compiled

# Elements of one chunk's [tokens, V_local] float32 temporary. Run eagerly, forward and backward hold two at
# a time, so ~1 GiB in all instead of several logits-sized float32 copies (compiled, the chunk's bf16 gradient
# is the only one); at 151936 columns a chunk is still ~880 tokens, a dozen chunks for a 10240-token
# micro-batch: too few kernel launches to matter.
CHUNK_ELEMENTS = 2 ** 27


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, vocab_size: int, with_entropy: bool,
                            entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """logits [b, s, V_local] (this rank's vocab slice), targets [b, s] global token ids ->
    (log p(target) [b, s], entropy [b, s] or None), float32 (float64 for float64 logits), identical on
    every TP rank, differentiable w.r.t. logits.
    entropy_grad=False: the entropy is a metric only (no entropy bonus); it is returned without gradient and
    the backward does no entropy work."""
    logprobs, entropy = _VocabParallelLogprobs.apply(logits, targets, vocab_size, with_entropy, entropy_grad)
    return logprobs, entropy if with_entropy else None


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_size: int, with_entropy: bool, entropy_grad: bool):
        local = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        real = min(max(vocab_size - start, 0), local)  # this slice's columns that are not vocab padding
        dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.reshape(-1, local)
        n = x.shape[0]
        owned = (targets >= start) & (targets < start + real)
        local_ids = torch.where(owned, targets - start, 0).reshape(-1, 1)

        # Per token: local max, then sums of exp(x - max) (and of exp(x - max) * (x - max) for H).
        local_max = torch.full((n,), float("-inf"), dtype=dtype, device=logits.device)
        sums = torch.zeros((3 if with_entropy else 2, n), dtype=dtype, device=logits.device)
        sums[-1] = torch.where(owned.reshape(-1), torch.gather(x, 1, local_ids).squeeze(1).to(dtype), 0.0)
        if real:
            for rows in _chunks(n, local):
                local_max[rows], sums[:-1, rows] = _CHUNK_SUMS(x[rows, :real], dtype, with_entropy)

        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        global_max = local_max.clone()
        if tp > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        if real:  # rebase this rank's sums from its own max to the global one (an all-padding slice adds 0)
            offset = local_max - global_max
            if with_entropy:
                sums[1] += offset * sums[0]
            sums[:-1] *= torch.exp(offset)
        if tp > 1:
            dist.all_reduce(sums, group=group)

        log_z = global_max + torch.log(sums[0])
        logprobs = (sums[-1] - log_z).view_as(targets)
        entropy = (torch.log(sums[0]) - sums[1] / sums[0]).view_as(targets) if with_entropy else None

        ctx.real = real
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(logits, local_ids, owned, log_z, entropy if ctx.entropy_grad else None)
        ctx.set_materialize_grads(False)
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        logits, local_ids, owned, log_z, entropy = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy = None
        if (grad_logprobs is None and grad_entropy is None) or not ctx.real:
            return torch.zeros_like(logits), None, None, None, None
        local, real = logits.shape[-1], ctx.real
        x = logits.reshape(-1, local)
        grad = torch.empty_like(x)
        grad[:, real:] = 0  # vocab padding
        # Per token, d loss / d x_j = p_j (a log p_j + c) + [j = t] g_lp, with a = -g_H and c = -(g_lp + g_H H)
        # (no entropy gradient: a = 0, c = -g_lp).
        g_lp = (torch.zeros_like(log_z) if grad_logprobs is None else grad_logprobs.reshape(-1)).unsqueeze(-1)
        if grad_entropy is None:
            a, c = None, -g_lp
        else:
            a = -grad_entropy.reshape(-1, 1)
            c = a * entropy.reshape(-1, 1) - g_lp
        log_z, owned = log_z.unsqueeze(-1), owned.reshape(-1, 1)
        for rows in _chunks(x.shape[0], local):
            grad[rows, :real] = _CHUNK_GRAD(x[rows, :real], log_z[rows], None if a is None else a[rows], c[rows])
            # The target's column gets the one-hot term, added in float32 before the one rounding to the
            # logits' dtype; on the ranks that do not own the target, the scatter writes back what is there.
            log_p_t = x[rows].gather(1, local_ids[rows]) - log_z[rows]
            grad_t = log_p_t.exp() * (c[rows] if a is None else a[rows] * log_p_t + c[rows])
            chunk = grad[rows]
            kept = chunk.gather(1, local_ids[rows])
            chunk.scatter_(1, local_ids[rows], torch.where(owned[rows], (grad_t + g_lp[rows]).to(grad.dtype), kept))
        return grad.view_as(logits), None, None, None, None


def _chunk_sums(chunk: Tensor, dtype: torch.dtype, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """A chunk of logits [rows, cols] -> per row: its max m, and [sum exp(x - m)(, sum exp(x - m)(x - m))]."""
    m = chunk.amax(-1).to(dtype)
    shifted = chunk - m.unsqueeze(-1)  # promotes bf16 to float32
    e = torch.exp(shifted)
    sums = [e.sum(-1)]
    if with_entropy:
        sums.append(e.mul_(shifted).sum(-1))
    return m, torch.stack(sums)


def _chunk_grad(chunk: Tensor, log_z: Tensor, a: Tensor | None, c: Tensor) -> Tensor:
    """p (a log p + c) in the logits' dtype, per row's a, c [rows, 1] (a=None: a = 0)."""
    log_p = chunk - log_z
    p = torch.exp(log_p)
    return p.mul_(c if a is None else log_p.mul_(a).add_(c)).to(chunk.dtype)


# inductor makes one fused kernel of each on the GPU, reading the bf16 chunk once or twice, where eager torch
# makes a float32 pass per operation (roughly 20 bytes per logit each way instead of 4-6)
_CHUNK_SUMS = Compiled(_chunk_sums, dynamic=True)
_CHUNK_GRAD = Compiled(_chunk_grad, dynamic=True)


def _chunks(n: int, width: int):
    """Row slices of at most CHUNK_ELEMENTS elements at `width` columns (at least one row each)."""
    step = max(1, CHUNK_ELEMENTS // width)
    return (slice(i, min(i + step, n)) for i in range(0, n, step))


@torch.no_grad()
def vocab_parallel_sum_squared_probs(logits: Tensor, vocab_size: int) -> Tensor:
    """logits [b, s, V_local] (this rank's vocab slice) -> sum over the whole vocabulary of p(v)^2 [b, s],
    float32, identical on every TP rank (the optimal token baseline's path variance, advantages.py). Per token
    a rank reduces its slice to a max m_r, s_r = sum exp(x - m_r) and q_r = sum exp(2 (x - m_r)); rebased to
    the global max M (times exp(m_r - M), resp. its square) and summed over TP ranks, sum p^2 = Q / S^2.
    Forward only: no gradient."""
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    real = min(max(vocab_size - start, 0), local)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    x = logits.reshape(-1, local)
    n = x.shape[0]
    local_max = torch.full((n,), float("-inf"), dtype=dtype, device=logits.device)
    sums = torch.zeros((2, n), dtype=dtype, device=logits.device)
    for rows in _chunks(n, local) if real else ():
        chunk = x[rows, :real]
        local_max[rows] = chunk.amax(-1).to(dtype)
        e = torch.exp(chunk - local_max[rows].unsqueeze(-1))
        sums[0, rows], sums[1, rows] = e.sum(-1), (e * e).sum(-1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    global_max = local_max.clone()
    if tp > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    if real:  # an all-padding slice adds 0
        scale = torch.exp(local_max - global_max)
        sums[0] *= scale
        sums[1] *= scale * scale
    if tp > 1:
        dist.all_reduce(sums, group=group)
    return (sums[1] / sums[0] ** 2).view(logits.shape[:-1]).float()
