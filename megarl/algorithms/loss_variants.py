"""Policy losses beyond PPO's clipped surrogate, registered in POLICY_LOSSES beside ppo_clip, dual_clip and gspo.

Same contract as losses.py: `fn(logprobs [b,T], mb, cfg) -> (per-token loss [b,T], per-token metrics)`, the
per-token loss then reduced by algorithm.loss_agg. Each docstring gives the paper's formula and says where
megarl follows verl instead. Clip-Cov and KL-Cov pick tokens by a covariance over the micro-batch the loss
sees (as verl); every rank of a model-parallel group sees the same micro-batch, so they pick the same ones.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from megarl.algorithms.losses import POLICY_LOSSES, clipped_surrogate, token_log_ratio
from megarl.config import AlgorithmConfig


def _ratio_metrics(log_ratio: Tensor) -> dict[str, Tensor]:
    return {"approx_kl": -log_ratio.detach(), "ratio": torch.exp(log_ratio).detach()}


@POLICY_LOSSES.register("reinforce")
@POLICY_LOSSES.register("gpg")
def gpg(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025): the plain policy gradient, -A * log p per token (no ratio, no clipping; with
    loss_agg=token-mean the paper's 1 / sum |o_i|). Its gradient is -A * grad log p, PPO's on-policy gradient.
    Pair it with advantage=gpg. Also registered as 'reinforce' (REINFORCE's loss, for bypass mode)."""
    return -mb["advantages"].float() * logprobs.float(), _ratio_metrics(token_log_ratio(logprobs, mb))


@POLICY_LOSSES.register("gmpo")
def gmpo(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, geometric-mean policy optimisation): per sequence, -A * exp(mean_t of
    sgn(A) * min(sgn(A) * log r_t, sgn(A) * clip(log r_t, -eps, eps))), the geometric mean of the token
    ratios, each clipped in log space on its pessimistic side (eps = cfg.gmpo.clip_eps, the paper's 0.4).
    A is the sequence's mean advantage (outcome estimators). Every response token carries its sequence's
    loss, so loss_agg=seq-mean-token-mean gives the paper's (and verl's) mean over sequences.
    Metric 'clipfrac': tokens whose log-ratio was clipped."""
    valid = mb["loss_mask"] > 0
    count = valid.sum(-1).clamp(min=1)
    log_ratio = token_log_ratio(logprobs, mb)
    advantages = torch.where(valid, mb["advantages"].float(), 0.0).sum(-1) / count
    sign = torch.sign(advantages)[:, None]
    clipped = log_ratio.clamp(-cfg.gmpo.clip_eps, cfg.gmpo.clip_eps)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    mean_log_ratio = torch.where(valid, pessimistic, 0.0).sum(-1) / count
    loss = (-advantages * torch.exp(mean_log_ratio))[:, None].expand_as(log_ratio)
    return loss, _ratio_metrics(log_ratio) | {"clipfrac": (clipped != log_ratio).float()}


@POLICY_LOSSES.register("cispo")
def cispo(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log p per token. The clipped
    importance weight is a constant, so every token keeps a gradient (-w * A * grad log p), where PPO's clip
    drops the clipped tokens'. eps = cfg.cispo.clip_eps_low / clip_eps_high (the paper: no lower bound,
    eps_low = 1). Metric 'clipfrac': tokens whose weight was clipped."""
    log_ratio = token_log_ratio(logprobs, mb)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - cfg.cispo.clip_eps_low, 1 + cfg.cispo.clip_eps_high).detach()
    loss = -weight * mb["advantages"].float() * logprobs.float()
    return loss, _ratio_metrics(log_ratio) | {"clipfrac": (weight != ratio).float()}


@POLICY_LOSSES.register("sapo")
def sapo(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, soft adaptive policy optimisation): -f(r) * A per token with the smooth gate
    f(r) = sigmoid(tau * (r - 1)) * 4 / tau in place of the hard clip: f(1) = 2 / tau and f'(r) =
    4 * sigmoid * (1 - sigmoid), 1 at r = 1, fading as r leaves 1. tau = cfg.sapo.tau_pos where A > 0, else
    cfg.sapo.tau_neg (verl's defaults 1.0 / 1.05)."""
    log_ratio = token_log_ratio(logprobs, mb)
    advantages = mb["advantages"].float()
    tau = torch.where(advantages > 0, cfg.sapo.tau_pos, cfg.sapo.tau_neg)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1)) * 4 / tau
    return -gate * advantages, _ratio_metrics(log_ratio)


def _token_covariance(logprobs: Tensor, mb: dict[str, Tensor]) -> Tensor:
    """(A - mean A) * (log p - mean log p) per token, means over the micro-batch's response tokens; detached."""
    valid = mb["loss_mask"] > 0
    count = valid.sum().clamp(min=1)
    advantages, current = mb["advantages"].float(), logprobs.detach().float()
    mean_adv = torch.where(valid, advantages, 0.0).sum() / count
    mean_lp = torch.where(valid, current, 0.0).sum() / count
    return (advantages - mean_adv) * (current - mean_lp)


def _picked(count: int, ratio: float) -> int:
    return max(int(ratio * count), 1)


@POLICY_LOSSES.register("clip_cov")
def clip_cov(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, the entropy mechanism of RL for reasoning LMs): PPO's clipped surrogate
    (clip_eps / clip_eps_high), except that max(1, clip_cov.ratio * N) tokens drawn at random among the
    micro-batch's N response tokens not already clipped whose covariance (A - mean A)(log p - mean log p) lies
    in (clip_cov.lb, clip_cov.ub) get loss 0 (no gradient): the high-covariance tokens that drive entropy
    collapse. Metric 'clipfrac': the tokens cut that way.

    Convention: the draw uses a generator seeded from the micro-batch's old log-probs, so every rank of a
    model-parallel group (same micro-batch) draws the same tokens and a rerun draws them again."""
    log_ratio = token_log_ratio(logprobs, mb)
    loss, metrics = clipped_surrogate(torch.exp(log_ratio), mb["advantages"].float(), cfg.clip_eps,
                                       cfg.clip_eps_high or cfg.clip_eps)
    valid = mb["loss_mask"] > 0
    covariance = _token_covariance(logprobs, mb)
    eligible = valid & (metrics["clipfrac"] == 0) & (covariance > cfg.clip_cov.lb) & (covariance < cfg.clip_cov.ub)
    candidates = eligible.flatten().nonzero().squeeze(-1)
    generator = torch.Generator().manual_seed(_micro_batch_seed(mb))
    order = torch.randperm(len(candidates), generator=generator).to(candidates.device)
    chosen = candidates[order[:_picked(int(valid.sum()), cfg.clip_cov.ratio)]]
    cut = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    cut[chosen] = True
    cut = cut.view_as(valid)
    return torch.where(cut, 0.0, loss), _ratio_metrics(log_ratio) | {"clipfrac": cut.float()}


@POLICY_LOSSES.register("kl_cov")
def kl_cov(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A * r per token, plus kl_cov.coef * |log r| on the
    max(1, kl_cov.ratio * N) response tokens of the micro-batch with the largest covariance
    (A - mean A)(log p - mean log p). Metric 'kl_cov_frac': the tokens penalised."""
    log_ratio = token_log_ratio(logprobs, mb)
    loss = -mb["advantages"].float() * torch.exp(log_ratio)
    valid = mb["loss_mask"] > 0
    covariance = torch.where(valid, _token_covariance(logprobs, mb), float("-inf")).flatten()
    top = covariance.topk(min(_picked(int(valid.sum()), cfg.kl_cov.ratio), int(valid.sum()))).indices
    penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    penalised[top] = True
    penalised = penalised.view_as(valid)
    loss = torch.where(penalised, loss + cfg.kl_cov.coef * log_ratio.abs(), loss)
    return loss, _ratio_metrics(log_ratio) | {"kl_cov_frac": penalised.float()}


def _micro_batch_seed(mb: dict[str, Tensor]) -> int:
    """A seed that depends only on the micro-batch's content (its old log-probs, bit for bit)."""
    bits = mb["old_logprobs"].detach().float().cpu().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(bits, digest_size=8).digest(), "little") % (1 << 63)
