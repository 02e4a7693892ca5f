"""Policy losses, KL and entropy terms, and how per-token values are reduced over a mini-batch.

Every reduction here returns a *contribution*: a micro-batch's share of the mini-batch mean, divided
by the mini-batch's global counts (`total_tokens`, `total_seqs`, over all micro-batches and all
data-parallel ranks). Summing the contributions of every micro-batch on every rank gives the mean, so
gradient accumulation and the data-parallel all-reduce (a sum) need no further rescaling, however
unevenly tokens fall between micro-batches.

Registries users extend:
  POLICY_LOSSES  `fn(logprobs [b,T], mb, cfg) -> (per-token loss [b,T], per-token metrics {name: [b,T]})`
  AGGREGATIONS   `fn(values [b,T], mask [b,T], total_tokens, total_seqs) -> scalar contribution`
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.config import AlgorithmConfig
from megarl.utils.registry import Registry

POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("loss aggregation")

# exp() of a log-ratio above ~88 overflows float32; past 20 the ratio is already 5e8, far outside any
# clip range, so clamping there changes nothing but keeps inf (and then NaN gradients) out.
MAX_LOG_RATIO = 20.0


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # torch.where rather than values * mask: a non-finite value at a padding position must not leak in.
    return torch.where(mask > 0, values, torch.zeros_like(values))


# ---------------------------------------------------------------------------------------------
# Aggregation


@AGGREGATIONS.register("token-mean")
def token_mean(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float) -> Tensor:
    """Every response token weighs the same: sum(v * mask) / total_tokens."""
    return _masked(values, mask).sum() / max(total_tokens, 1)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float) -> Tensor:
    """Sum over each sequence's tokens, mean over sequences: sum(v * mask) / total_seqs."""
    return _masked(values, mask).sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float) -> Tensor:
    """Mean over each sequence's tokens, then mean over sequences (every sequence weighs the same).
    A sequence without response tokens contributes 0 but still counts in total_seqs."""
    per_seq = _masked(values, mask).sum(-1) / (mask > 0).sum(-1).clamp(min=1)
    return per_seq.sum() / max(total_seqs, 1)


def aggregate(values: Tensor, mask: Tensor, mode: str, total_tokens: float, total_seqs: float) -> Tensor:
    """This micro-batch's contribution to the mini-batch reduction `mode` of `values` over `mask`."""
    return AGGREGATIONS.get(mode)(values, mask, total_tokens, total_seqs)


# ---------------------------------------------------------------------------------------------
# Policy losses


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate, per token: max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)).

    Metrics per token: `clipfrac` is 1 where the clipped term is the larger one (clipping is active and
    the token's gradient is cut), `approx_kl` is old - new log-prob (k1 estimate of KL(old || new)),
    `ratio` is new / old probability.
    """
    advantages = mb["advantages"].float()
    log_ratio = (logprobs.float() - mb["old_logprobs"].float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    eps_low, eps_high = cfg.clip_eps, cfg.clip_eps_high or cfg.clip_eps
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {"clipfrac": (clipped > unclipped).float(), "approx_kl": -log_ratio.detach(),
                  "ratio": ratio.detach()}


# ---------------------------------------------------------------------------------------------
# KL to the reference policy, entropy, SFT


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's estimators):
    k1 = lp - ref (unbiased, high variance, can be negative); k2 = (lp - ref)^2 / 2;
    k3 = exp(ref - lp) - (ref - lp) - 1 (unbiased, always >= 0, low variance)."""
    log_ratio = (logprobs.float() - ref_logprobs.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator '{estimator}': must be one of k1, k2, k3")


def actor_loss(cfg: AlgorithmConfig, logprobs: Tensor, entropy: Tensor | None, mb: dict[str, Tensor],
               total_tokens: float, total_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's contribution to the mini-batch loss, and its metrics (same convention).

    loss = pg_loss + kl_coef * kl - entropy_coef * entropy, each reduced with cfg.loss_agg; the metrics
    'pg_loss', 'kl' and 'entropy' are exactly those reduced terms. The policy loss's own diagnostics
    ('clipfrac', 'approx_kl', 'ratio' for ppo_clip) are token means whatever cfg.loss_agg is.
    mb holds 'loss_mask', 'old_logprobs', 'advantages', and 'ref_logprobs' when cfg.kl_coef > 0.
    """
    mask = mb["loss_mask"]

    def reduce(values: Tensor) -> Tensor:
        return aggregate(values, mask, cfg.loss_agg, total_tokens, total_seqs)

    per_token_loss, per_token_metrics = POLICY_LOSSES.get(cfg.policy_loss)(logprobs, mb, cfg)
    loss = pg_loss = reduce(per_token_loss)
    metrics = {"pg_loss": pg_loss.detach()}
    for name, values in per_token_metrics.items():
        metrics[name] = token_mean(values.detach(), mask, total_tokens, total_seqs)

    if cfg.kl_coef > 0:
        if "ref_logprobs" not in mb:
            raise KeyError("algorithm.kl_coef > 0 but the micro-batch has no 'ref_logprobs'")
        kl = reduce(kl_penalty(logprobs, mb["ref_logprobs"], cfg.kl_estimator))
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()

    if entropy is not None:
        mean_entropy = reduce(entropy.float())
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.detach()
    elif cfg.entropy_coef:
        raise ValueError("algorithm.entropy_coef != 0 but no entropy was computed for the micro-batch")
    return loss, metrics


def sft_loss(logprobs: Tensor, mask: Tensor, total_tokens: float) -> Tensor:
    """Negative log-likelihood of the masked tokens, as a contribution to the token mean."""
    return -token_mean(logprobs.float(), mask, total_tokens, 0)
