"""Rollout correction: the rollout engine's log-probs against the trainer's, and the decoupled PPO objective.

The rollout engine samples from pi_rollout; the trainer computes pi_old (its weights before the update, the
'old log-probs') on the same tokens. They differ by kernels and precision, and in the asynchronous modes by
policy versions. Three families of corrections, as verl's rollout_corr (verl/trainer/ppo/rollout_corr_helper.py)
names them (config section algorithm.rollout_correction):

- importance weights w = pi_old / pi_rollout on the policy loss, per token or per sequence (the product over
  the response), truncated at a threshold (TIS) or zero outside a band (IcePop's mask), optionally divided
  by their batch mean;
- rejection: tokens or whole sequences whose ratio leaves a band are dropped from the loss mask;
- bypass mode: the rollout's log-probs are the old log-probs (no forward pass for them).

Where they are computed. Outside bypass mode, on the driver (`apply_rollout_correction`) after the old
log-probs, on the whole batch: the batch mean of the weights and the token counts of the loss after
rejection need the whole batch. In bypass mode the weights compare the policy being trained with the
rollout's, so they are computed in the loss (`correct_policy_loss`), micro-batch by micro-batch, as verl does.

Also here: algorithm.tis (the token TIS megarl had first) and the decoupled PPO objective (Hilton et al. 2022;
AReaL), both per-token weights pi_old / pi_rollout computed in the loss; and the mismatch metrics
(`mismatch_metrics`): KL and perplexity ratio between the rollout's and the trainer's log-probs.

Convention: megarl's ratio is always pi_old / pi_rollout (trainer over rollout). verl's *_k1 rejection
options bound -log of it, i.e. the inverse ratio; with its default band (lower = 1 / upper) the two agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megarl.algorithms.kl import MAX_LOG_RATIO
from megarl.config import AlgorithmConfig
from megarl.config.sections import RolloutCorrectionConfig
from megarl.protocol import Batch

PREFIX = "rollout_corr/"  # the driver's metric names, as verl's


def _sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where mask (bool) holds; a non-finite value outside it does not leak in."""
    masked = torch.where(mask, values, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim)


def _bounds(upper: float, lower: float) -> tuple[float, float]:
    """(lower, upper) of a band on the ratio; lower 0 means 1 / upper."""
    return (lower or 1.0 / upper), upper


# ---------------------------------------------------------------------------------------------
# Importance weights and rejection, from log_ratio = log pi_train - log pi_rollout [B, T]


def importance_weights(log_ratio: Tensor, valid: Tensor, rc: RolloutCorrectionConfig) -> tuple[Tensor, Tensor]:
    """(weights, raw weights) [B, T], 0 outside `valid`: rc.rollout_is = token: exp(log_ratio) per token;
    sequence: exp(sum of the row's log_ratio) on every token of the row. Then truncated, min(w, threshold),
    or masked, w outside [lower, threshold] -> 0 (rc.rollout_is_mode). Detached."""
    log_ratio = log_ratio.detach().float()
    if rc.rollout_is == "token":
        log_w = log_ratio
    elif rc.rollout_is == "sequence":
        log_w = _sum(log_ratio, valid, -1)[:, None].expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={rc.rollout_is!r}: must be none, token or sequence")
    raw = torch.where(valid, torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), torch.zeros_like(log_w))
    lower, upper = _bounds(rc.rollout_is_threshold, rc.rollout_is_threshold_lower)
    if rc.rollout_is_mode == "truncate":
        return raw.clamp(max=upper), raw
    inside = (raw >= lower) & (raw <= upper)
    return torch.where(inside, raw, torch.zeros_like(raw)), raw


def rejection_keep(log_ratio: Tensor, valid: Tensor, rc: RolloutCorrectionConfig) -> Tensor:
    """Bool [B, T]: the tokens that pass rc.rollout_rs, i.e. whose ratio stays in [lower, threshold]: token_k1
    each token's pi_train / pi_rollout; seq_sum_k1 the row's product of them; seq_mean_k1 their geometric mean
    (the product to the power 1 / response length). A sequence test keeps or drops every token of the row."""
    log_ratio = log_ratio.detach().float()
    if rc.rollout_rs == "token_k1":
        statistic = log_ratio
    elif rc.rollout_rs in ("seq_sum_k1", "seq_mean_k1"):
        per_row = _sum(log_ratio, valid, -1)
        if rc.rollout_rs == "seq_mean_k1":
            per_row = per_row / valid.sum(-1).clamp(min=1)
        statistic = per_row[:, None].expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs!r}: must be none, token_k1, "
                         "seq_sum_k1 or seq_mean_k1")
    lower, upper = _bounds(rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower)
    return (statistic >= math.log(lower)) & (statistic <= math.log(upper))


# ---------------------------------------------------------------------------------------------
# Mismatch metrics


def mismatch_metrics(train_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, total_tokens: float,
                     total_seqs: float) -> dict[str, Tensor]:
    """How far the rollout's log-probs are from the trainer's on the same tokens (verl's off-policy metrics), as
    contributions to means over `total_tokens` response tokens and `total_seqs` sequences (the engine sums
    them over micro-batches and ranks; on a whole batch they are the means), named rollout_corr/...:

    kl           mean over tokens of log pi_rollout - log pi_train (k1 estimate of KL(rollout || train))
    k3_kl        mean over tokens of r - log r - 1, r = pi_train / pi_rollout (k3 estimate of the same KL)
    chi2_token   mean over tokens of r^2 - 1
    training_ppl, rollout_ppl   mean over sequences of exp(-mean log-prob of the sequence's tokens)
    log_ppl_diff mean over sequences of (mean rollout log-prob - mean train log-prob) = log(train ppl / rollout ppl)
    ppl_ratio    mean over sequences of exp(log_ppl_diff): training ppl / rollout ppl
    chi2_seq     mean over sequences of (prod of r)^2 - 1

    A sequence without response tokens counts as one with no mismatch (ppl 1, ratio 1)."""
    valid = mask > 0
    train, rollout = train_logprobs.detach().float(), rollout_logprobs.detach().float()
    log_r = (train - rollout).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    tokens, seqs = max(total_tokens, 1), max(total_seqs, 1)
    lengths = valid.sum(-1).clamp(min=1)
    mean_train, mean_rollout = _sum(train, valid, -1) / lengths, _sum(rollout, valid, -1) / lengths
    log_ppl_diff = mean_rollout - mean_train
    seq_log_r = _sum(train - rollout, valid, -1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    metrics = {"kl": _sum(rollout - train, valid) / tokens,
               "k3_kl": _sum(torch.exp(log_r) - log_r - 1, valid) / tokens,
               "chi2_token": _sum(torch.exp(2 * log_r) - 1, valid) / tokens,
               "training_ppl": torch.exp(-mean_train).sum() / seqs,
               "rollout_ppl": torch.exp(-mean_rollout).sum() / seqs,
               "log_ppl_diff": log_ppl_diff.sum() / seqs,
               "ppl_ratio": torch.exp(log_ppl_diff).sum() / seqs,
               "chi2_seq": (torch.exp(2 * seq_log_r) - 1).sum() / seqs}
    return {PREFIX + name: value for name, value in metrics.items()}


# ---------------------------------------------------------------------------------------------
# On the driver


def apply_rollout_correction(batch: Batch, rc: RolloutCorrectionConfig) -> dict[str, float]:
    """The driver's part (outside bypass mode), on the batch with its 'old_logprobs' and 'rollout_logprobs':
    sets batch['rollout_is_weights'] [B, T] (rc.rollout_is), removes rejected tokens from batch['loss_mask']
    (rc.rollout_rs: every later stage, advantages, critic and the loss's token counts, then leaves them out, as
    verl's response_mask), and returns the step's metrics: the mismatch metrics, and for the weights
    rollout_is_mean (of the applied weights, before the batch normalisation), rollout_is_ratio_fraction_high /
    _low (raw weights above the threshold / below its lower bound: tokens, or sequences for sequence weights),
    rollout_is_eff_sample_size (1 / mean of (w / mean w)^2), rollout_is_batch_norm_factor; for the rejection
    rollout_rs_masked_fraction (of the response tokens) and rollout_rs_seq_masked_fraction (of the sequences:
    those with a rejected token). Weights and metrics use the loss mask before the rejection."""
    mask = batch["loss_mask"]
    valid = mask > 0
    log_ratio = batch["old_logprobs"].float() - batch["rollout_logprobs"].float()
    n_tokens = valid.sum().clamp(min=1)
    metrics = mismatch_metrics(batch["old_logprobs"], batch["rollout_logprobs"], mask, n_tokens.item(), len(batch))
    if rc.rollout_is != "none":
        weights, raw = importance_weights(log_ratio, valid, rc)
        lower, upper = _bounds(rc.rollout_is_threshold, rc.rollout_is_threshold_lower)
        if rc.rollout_is == "sequence":  # one weight per sequence: the fractions count sequences
            rows = valid.any(-1)
            per_row_raw = raw.max(-1).values[rows]
            metrics |= {"rollout_is_ratio_fraction_high": (per_row_raw > upper).float().mean(),
                        "rollout_is_ratio_fraction_low": (per_row_raw < lower).float().mean()}
        else:
            metrics |= {"rollout_is_ratio_fraction_high": _sum((raw > upper).float(), valid) / n_tokens,
                        "rollout_is_ratio_fraction_low": _sum((raw < lower).float(), valid) / n_tokens}
        mean = _sum(weights, valid) / n_tokens
        metrics |= {"rollout_is_mean": mean,
                    "rollout_is_eff_sample_size": 1.0 / (_sum((weights / mean.clamp(min=1e-8)) ** 2, valid) / n_tokens)}
        if rc.rollout_is_batch_normalize:
            # the mean over what carries one weight each: tokens, or sequences (every token of a row holds its weight)
            norm = mean if rc.rollout_is == "token" else weights.max(-1).values[valid.any(-1)].mean()
            weights = weights / norm if norm > 1e-8 else weights
            metrics["rollout_is_batch_norm_factor"] = norm
        batch["rollout_is_weights"] = weights
    if rc.rollout_rs != "none":
        keep = rejection_keep(log_ratio, valid, rc)
        rejected = valid & ~keep
        metrics |= {"rollout_rs_masked_fraction": rejected.sum() / n_tokens,
                    "rollout_rs_seq_masked_fraction": rejected.any(-1).float().mean()}
        batch["loss_mask"] = torch.where(keep, mask, torch.zeros_like(mask))
    return {(k if k.startswith(PREFIX) else PREFIX + k): float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------
# In the loss


def truncated_is_weight(mb: dict[str, Tensor], cap: float) -> Tensor:
    """Truncated importance sampling (TIS, Yao et al. 2025; algorithm.tis): min(exp(old - rollout log-prob), cap),
    detached. The rollout engine sampled from a slightly different distribution than the trainer computes
    (kernels, precision); the weight corrects the policy gradient for that mismatch.

    Convention: the ratio is trainer-old / rollout (as verl's tis_imp_ratio_cap and slime), capped from
    above only (no lower bound)."""
    if "rollout_logprobs" not in mb:
        raise KeyError("algorithm.tis is on but the micro-batch has no 'rollout_logprobs'")
    log_ratio = (mb["old_logprobs"].float() - mb["rollout_logprobs"].float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap).detach()


def decoupled_weight(mb: dict[str, Tensor], rc: RolloutCorrectionConfig) -> tuple[Tensor, Tensor]:
    """The decoupled PPO objective's behaviour weight (Hilton et al. 2022, "Batch size-invariance for policy
    optimization"; AReaL, Fu et al. 2025): w = pi_prox / pi_behav = exp(old - rollout log-prob), detached, with
    the proximal policy pi_prox = the trainer's weights before the update (the old log-probs) and pi_behav the
    rollout's. Over rc.decoupled_cap: truncated to the cap (truncate) or 0 (mask, AReaL's
    behav_imp_weight_cap). Returns (w, capped: 1.0 where the cap acted)."""
    if "rollout_logprobs" not in mb:
        raise KeyError("algorithm.rollout_correction.decoupled is on but the micro-batch has no 'rollout_logprobs'")
    log_w = (mb["old_logprobs"].float() - mb["rollout_logprobs"].float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    w = torch.exp(log_w).detach()
    capped = w > rc.decoupled_cap
    w = w.clamp(max=rc.decoupled_cap) if rc.decoupled_cap_mode == "truncate" else torch.where(capped, 0.0, w)
    return w, capped.float()


def correct_policy_loss(per_token_loss: Tensor, logprobs: Tensor, mb: dict[str, Tensor],
                        cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token policy loss times the weights the config asks for, and their per-token metrics (actor_loss
    averages them over tokens): algorithm.tis ('tis_weight'); the decoupled objective ('decoupled_weight',
    'decoupled_capped'); the driver's mb['rollout_is_weights'] ('rollout_is_weight'). In bypass mode the
    weights and the rejection compare the policy being trained with the rollout's (mb['old_logprobs'] are the
    rollout's there): rollout_is weights ('rollout_is_weight') multiply the loss only of policy_loss=reinforce
    (a ratio loss's ratio already is pi / pi_rollout), and rejected tokens ('rollout_rs_rejected') contribute 0
    (the loss's token counts were taken before the update and still count them, as in verl's bypass mode)."""
    rc = cfg.rollout_correction
    weights, metrics, kept = {}, {}, None
    if cfg.tis:
        weights["tis_weight"] = truncated_is_weight(mb, cfg.tis_cap)
    if rc.decoupled:
        weights["decoupled_weight"], metrics["decoupled_capped"] = decoupled_weight(mb, rc)
    if "rollout_is_weights" in mb:
        weights["rollout_is_weight"] = mb["rollout_is_weights"].float()
    if rc.bypass_mode:
        valid = mb["loss_mask"] > 0
        log_ratio = logprobs.detach().float() - mb["old_logprobs"].float()
        if rc.rollout_is != "none" and cfg.policy_loss == "reinforce":
            weights["rollout_is_weight"] = importance_weights(log_ratio, valid, rc)[0]
        if rc.rollout_rs != "none":
            kept = rejection_keep(log_ratio, valid, rc)
            metrics["rollout_rs_rejected"] = (~kept).float()
    for name, weight in weights.items():
        per_token_loss = per_token_loss * weight
        metrics[name] = weight
    if kept is not None:  # where, not a product: a rejected token's loss may be far out of range
        per_token_loss = torch.where(kept, per_token_loss, torch.zeros_like(per_token_loss))
    return per_token_loss, metrics


def batch_keys(cfg: AlgorithmConfig) -> list[str]:
    """The batch tensors correct_policy_loss reads (beyond the policy loss's own)."""
    rc = cfg.rollout_correction
    keys = ["rollout_logprobs"] if cfg.tis or rc.decoupled or rc.bypass_mode else []
    return keys + (["rollout_is_weights"] if rc.rollout_is != "none" and not rc.bypass_mode else [])
