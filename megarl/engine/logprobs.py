"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary. The log-softmax normaliser is
built from a max and a sum of exponentials all-reduced over the TP group, as megatron's
vocab_parallel_cross_entropy does. The reductions go through megatron's
reduce_from_tensor_model_parallel_region (all-reduce forward, identity backward): every TP rank
computes the same loss, so each rank's backward already carries the full upstream gradient.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import Tensor


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, vocab_size: int, with_entropy: bool,
                            entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """logits [b, s, V_local] (this rank's vocab slice), targets [b, s] global token ids ->
    (log p(target) [b, s], entropy [b, s] or None), float32, identical on every TP rank.
    Vocab padding rows (ids >= vocab_size) are masked to -inf so they carry no probability.
    entropy_grad=False: the entropy is a metric only (no entropy bonus), computed outside autograd, which
    then keeps no [b, s, V_local] products for it."""
    logits = logits.float()
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    pad = torch.arange(start, start + local, device=logits.device) >= vocab_size
    if pad.any():
        logits = logits.masked_fill(pad, float("-inf"))

    # The max only stabilises exp(); the result does not depend on it, so it needs no gradient.
    shift = logits.detach().max(dim=-1).values
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    exp_logits = torch.exp(logits - shift.unsqueeze(-1))
    sum_exp = reduce_from_tensor_model_parallel_region(exp_logits.sum(-1))
    log_z = shift + torch.log(sum_exp)

    owned = (targets >= start) & (targets < start + local)
    local_ids = (targets - start).clamp(0, local - 1)
    target_logit = torch.gather(logits, -1, local_ids.unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tensor_model_parallel_region(torch.where(owned, target_logit, 0.0))
    logprobs = target_logit - log_z

    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = _entropy(logits, exp_logits, sum_exp, log_z, pad)
    return logprobs, entropy


def _entropy(logits: Tensor, exp_logits: Tensor, sum_exp: Tensor, log_z: Tensor, pad: Tensor) -> Tensor:
    """H = log Z - E_p[logit], with E_p[logit] = sum(exp * logit) / sum(exp). Each rank's share of both
    sums depends on its own logits only; computing p with the global log Z instead would miss the
    gradient that flows through the other ranks' shares. The pad entries' -inf is replaced by 0 in the
    product (their exp is exactly 0; 0 * -inf is nan)."""
    finite_logits = logits.masked_fill(pad, 0.0) if pad.any() else logits
    sum_exp_logit = reduce_from_tensor_model_parallel_region((exp_logits * finite_logits).sum(-1))
    return log_z - sum_exp_logit / sum_exp
