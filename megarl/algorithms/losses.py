"""Policy losses, KL and entropy terms, and how per-token values are reduced over a mini-batch.

Every reduction here returns a *contribution*: a micro-batch's share of the mini-batch mean, divided
by the mini-batch's global counts (`total_tokens`, `total_seqs`, over all micro-batches and all
data-parallel ranks). Summing the contributions of every micro-batch on every rank gives the mean, so
gradient accumulation and the data-parallel all-reduce (a sum) need no further rescaling, however
unevenly tokens fall between micro-batches.

Registries users extend:
  POLICY_LOSSES  `fn(logprobs [b,T], mb, cfg) -> (per-token loss [b,T], per-token metrics {name: [b,T]})`
  AGGREGATIONS   `fn(values [b,T], mask [b,T], total_tokens, total_seqs, cfg) -> scalar contribution`
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algorithms import rollout_correction
from megarl.algorithms.kl import MAX_LOG_RATIO, kl_penalty
from megarl.config import AlgorithmConfig
from megarl.utils.registry import Registry

POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("loss aggregation")


# GSPO's cap on log s (verl's): s = exp(10) = 22026 is far outside any clip range
GSPO_MAX_LOG_RATIO = 10.0


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # torch.where rather than values * mask: a non-finite value at a padding position must not leak in.
    return torch.where(mask > 0, values, torch.zeros_like(values))


# ---------------------------------------------------------------------------------------------
# Aggregation


@AGGREGATIONS.register("token-mean")
def token_mean(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float,
               cfg: AlgorithmConfig | None = None) -> Tensor:
    """Every response token weighs the same: sum(v * mask) / total_tokens."""
    return _masked(values, mask).sum() / max(total_tokens, 1)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float,
                       cfg: AlgorithmConfig | None = None) -> Tensor:
    """Sum over each sequence's tokens, mean over sequences: sum(v * mask) / total_seqs."""
    return _masked(values, mask).sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float,
                        cfg: AlgorithmConfig | None = None) -> Tensor:
    """Mean over each sequence's tokens, then mean over sequences (every sequence weighs the same).
    A sequence without response tokens contributes 0 but still counts in total_seqs."""
    per_seq = _masked(values, mask).sum(-1) / (mask > 0).sum(-1).clamp(min=1)
    return per_seq.sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(values: Tensor, mask: Tensor, total_tokens: float, total_seqs: float,
                            cfg: AlgorithmConfig | None = None) -> Tensor:
    """Dr. GRPO: each sequence's token sum divided by the constant cfg.loss_agg_norm_len, then the mean over
    sequences: sum(v * mask) / (norm_len * total_seqs). No length bias, and unlike a per-batch token count
    the scale does not move from step to step.

    Convention: the constant comes from config (Dr. GRPO's max response length), not from the padded width
    of the batch (early verl divided by loss_mask.shape[-1], which changes with padding)."""
    norm_len = cfg.loss_agg_norm_len if cfg is not None else 0
    if norm_len < 1:
        raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs algorithm.loss_agg_norm_len >= 1, "
                         f"got {norm_len}")
    return _masked(values, mask).sum() / (norm_len * max(total_seqs, 1))


def aggregate(values: Tensor, mask: Tensor, mode: str, total_tokens: float, total_seqs: float,
              cfg: AlgorithmConfig | None = None) -> Tensor:
    """This micro-batch's contribution to the mini-batch reduction `mode` of `values` over `mask`."""
    return AGGREGATIONS.get(mode)(values, mask, total_tokens, total_seqs, cfg)


# ---------------------------------------------------------------------------------------------
# Policy losses


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                       dual_clip_c: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)); with dual_clip_c > 0, negative-advantage
    terms are further capped at -A * dual_clip_c, so a huge ratio cannot blow up the loss."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clipfrac": (clipped > unclipped).float()}
    if dual_clip_c:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clipfrac"] = dual.float()
    return loss, metrics


def token_log_ratio(logprobs: Tensor, mb: dict[str, Tensor]) -> Tensor:
    return (logprobs.float() - mb["old_logprobs"].float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate, per token: max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)).
    cfg.clip_eps_high > 0 makes the upper side wider (DAPO's clip-higher: eps 0.2 / 0.28).

    Metrics per token: `clipfrac` is 1 where the clipped term is the larger one (clipping is active and
    the token's gradient is cut), `approx_kl` is old - new log-prob (k1 estimate of KL(old || new)),
    `ratio` is new / old probability.
    """
    return _ppo(logprobs, mb, cfg, dual_clip_c=0.0)


@POLICY_LOSSES.register("dual_clip")
def dual_clip(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO (Ye et al. 2020): ppo_clip, and for A < 0 the loss is at most -A * cfg.dual_clip.clip_ratio_c,
    so a token whose ratio has run far above 1 + eps gets no gradient. Extra metric `dual_clipfrac`.

    Convention: as verl, the cap applies to the already-clipped term, min(max(...), -A * c)."""
    c = cfg.dual_clip.clip_ratio_c
    if c <= 1:
        raise ValueError(f"dual_clip needs algorithm.dual_clip.clip_ratio_c > 1, got {c}")
    return _ppo(logprobs, mb, cfg, dual_clip_c=c)


def _ppo(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig,
         dual_clip_c: float) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio = token_log_ratio(logprobs, mb)
    ratio = torch.exp(log_ratio)
    loss, metrics = clipped_surrogate(ratio, mb["advantages"].float(), cfg.clip_eps,
                                       cfg.clip_eps_high or cfg.clip_eps, dual_clip_c)
    return loss, metrics | {"approx_kl": -log_ratio.detach(), "ratio": ratio.detach()}


@POLICY_LOSSES.register("gspo")
def gspo(logprobs: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s = exp(mean over its response tokens of
    new - old log-prob), clipped with its own narrow range (cfg.gspo.clip_eps / clip_eps_high).

    Each response token t carries max(-A_t * s_t, -A_t * clip(s_t)) with s_t = sg(s) * p_t / sg(p_t), the
    paper's GSPO-token and verl's compute_policy_loss_gspo: s_t's value is s, and its gradient reaches token t
    only, so token t's gradient is -A_t * s * grad log p_t where unclipped, each token with its *own*
    advantage (GAE, REINFORCE++ with gamma < 1). With an advantage constant over the sequence (outcome
    estimators: grpo, rloo ...) and loss_agg=seq-mean-token-mean this equals the paper's sequence-level GSPO,
    -A * s averaged over sequences. log s is capped at GSPO_MAX_LOG_RATIO (as verl; no gradient past it)."""
    valid = mb["loss_mask"] > 0
    log_ratio = token_log_ratio(logprobs, mb)
    mean_log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(-1) / valid.sum(-1).clamp(min=1)
    current = logprobs.float()
    seq_log_ratio = (mean_log_ratio.detach()[:, None] + current - current.detach()).clamp(max=GSPO_MAX_LOG_RATIO)
    seq_ratio = torch.exp(seq_log_ratio)
    loss, metrics = clipped_surrogate(seq_ratio, mb["advantages"].float(), cfg.gspo.clip_eps,
                                       cfg.gspo.clip_eps_high)
    return loss, metrics | {"approx_kl": -log_ratio.detach(), "ratio": seq_ratio.detach()}


# ---------------------------------------------------------------------------------------------
# The actor loss (policy loss, KL, entropy), SFT


def policy_batch_keys(cfg: AlgorithmConfig) -> list[str]:
    """The batch's [B, T] tensors that actor_loss reads beyond 'loss_mask', 'advantages', 'old_logprobs',
    'ref_logprobs' and 'rollout_logprobs' (the engine puts them in every micro-batch)."""
    return (["lm_mask"] if cfg.positive_lm.coef > 0 else []) + rollout_correction.batch_keys(cfg)


def actor_loss(cfg: AlgorithmConfig, logprobs: Tensor, entropy: Tensor | None, mb: dict[str, Tensor],
               total_tokens: float, total_seqs: float,
               total_lm_tokens: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's contribution to the mini-batch loss, and its metrics (same convention).

    loss = pg_loss + kl_coef * kl - entropy_coef * entropy, each reduced with cfg.loss_agg; the metrics
    'pg_loss', 'kl' and 'entropy' are exactly those reduced terms. The per-token policy loss is first
    multiplied by the weights of rollout_correction.correct_policy_loss (cfg.tis: metric 'tis_weight'; the
    decoupled objective; the rollout correction's importance weights and rejection). With cfg.kl_in_reward the
    KL is already in the advantages and no KL term is added here. The policy loss's own diagnostics
    ('clipfrac', 'approx_kl', 'ratio' for ppo_clip) are token means whatever cfg.loss_agg is.
    With cfg.positive_lm.coef = mu > 0 (VAPO's positive-example LM loss) the loss also has
    mu * positive_lm_nll, the negative log-likelihood of the tokens in mb['lm_mask'] (the response tokens of
    samples whose reward reached cfg.positive_lm.threshold) averaged over the mini-batch's
    `total_lm_tokens` of them; a mini-batch without any contributes 0.
    mb holds 'loss_mask', 'old_logprobs', 'advantages', 'ref_logprobs' when the KL loss is on,
    'rollout_logprobs' when cfg.tis is on, and the keys of policy_batch_keys(cfg).
    """
    mask = mb["loss_mask"]

    def reduce(values: Tensor) -> Tensor:
        return aggregate(values, mask, cfg.loss_agg, total_tokens, total_seqs, cfg)

    per_token_loss, per_token_metrics = POLICY_LOSSES.get(cfg.policy_loss)(logprobs, mb, cfg)
    # algorithm.tis, the decoupled objective, the rollout correction's weights (megarl/algorithms/rollout_correction.py)
    per_token_loss, correction_metrics = rollout_correction.correct_policy_loss(per_token_loss, logprobs, mb, cfg)
    per_token_metrics = per_token_metrics | correction_metrics
    loss = pg_loss = reduce(per_token_loss)
    metrics = {"pg_loss": pg_loss.detach()}
    for name, values in per_token_metrics.items():
        metrics[name] = token_mean(values.detach(), mask, total_tokens, total_seqs)

    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        if "ref_logprobs" not in mb:
            raise KeyError("algorithm.kl_coef > 0 but the micro-batch has no 'ref_logprobs'")
        kl = reduce(kl_penalty(logprobs, mb["ref_logprobs"], cfg.kl_estimator, cfg.kl_clamp))
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()

    if cfg.positive_lm.coef > 0:
        if "lm_mask" not in mb:
            raise KeyError("algorithm.positive_lm.coef > 0 but the micro-batch has no 'lm_mask'")
        nll = -_masked(logprobs.float(), mb["lm_mask"]).sum() / max(total_lm_tokens, 1)
        loss = loss + cfg.positive_lm.coef * nll
        metrics["positive_lm_nll"] = nll.detach()

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


# ---------------------------------------------------------------------------------------------
# Critic and reward model


def value_loss(values: Tensor, mb: dict[str, Tensor], cfg: AlgorithmConfig, clip: float, total_tokens: float,
               total_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = V_old + clamp(V - V_old,
    -clip, clip), R = mb['returns'], V_old = mb['values'] (the critic before this step); clip <= 0: no
    clipping. Reduced with cfg.loss_agg; metrics 'vf_loss', 'vf_clipfrac' (tokens where the clipped term is
    the larger), 'vpred' (mean predicted value)."""
    mask = mb["loss_mask"]
    returns, old = mb["returns"].float(), mb["values"].float()
    values = values.float()
    squared_error = (values - returns) ** 2
    if clip > 0:
        clipped_error = (old + (values - old).clamp(-clip, clip) - returns) ** 2
        per_token = 0.5 * torch.maximum(squared_error, clipped_error)
        clipfrac = (clipped_error > squared_error).float()
    else:
        per_token, clipfrac = 0.5 * squared_error, torch.zeros_like(values)
    loss = aggregate(per_token, mask, cfg.loss_agg, total_tokens, total_seqs, cfg)
    return loss, {"vf_loss": loss.detach(),
                  "vf_clipfrac": token_mean(clipfrac, mask, total_tokens, total_seqs),
                  "vpred": token_mean(values.detach(), mask, total_tokens, total_seqs)}


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, total_pairs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward-model loss on preference pairs: -log sigmoid(r_chosen - r_rejected), as a contribution to the
    mean over all pairs; metrics 'accuracy' (r_chosen > r_rejected; a tie counts half, as in the held-out
    rm_trainer.pair_metrics) and 'margin' (mean r_chosen - r_rejected)."""
    margin = chosen.float() - rejected.float()
    loss = -torch.nn.functional.logsigmoid(margin).sum() / total_pairs
    won = (margin > 0).float() + 0.5 * (margin == 0).float()
    return loss, {"accuracy": won.sum() / total_pairs,
                  "margin": margin.detach().sum() / total_pairs}
