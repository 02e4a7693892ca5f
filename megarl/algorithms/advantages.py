"""Advantage estimators: `fn(batch, cfg) -> Tensor [B, T]`, registered in `ADVANTAGES`.

An estimator reads the scored batch (`rewards` [B], `group` [B] prompt ids, `loss_mask` [B, T]) and
returns per-token advantages, zero wherever `loss_mask` is 0. Users add their own with
`@ADVANTAGES.register("name")` or name one as `algorithm.advantage=my_pkg.mod:fn`.

Outcome estimators (grpo, rloo) give every response token its sequence's score. Token-level estimators
(gae, reinforce_plus_plus, reinforce_plus_plus_baseline, remax) start from `token_level_rewards`: the
sequence reward on the last response token, minus the KL penalty per token when algorithm.kl_in_reward.
Positions outside `loss_mask` (the prompt, padding, tool outputs inside a multi-turn response) are
skipped by the backward recursions: the next token of a response token is its next *trained* token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.algorithms.kl import kl_in_reward
from megarl.config import AlgorithmConfig
from megarl.protocol import Batch
from megarl.utils.registry import Registry

ADVANTAGES = Registry("advantage estimator")

STD_EPS = 1e-6  # keeps (r - mean) / (std + eps) finite when every reward of a group is equal
WHITEN_EPS = 1e-8  # (x - mean) / sqrt(var + eps): finite when every value is equal


def compute_advantages(batch: Batch, cfg: AlgorithmConfig) -> Batch:
    """Run the configured estimator and store its result as batch['advantages'].

    The token-level estimators also leave batch.meta['reward_kl'] (mean KL per response token, for logs and
    the adaptive KL controller) when the KL is in the reward; gae leaves batch['returns'] (value targets).
    With cfg.positive_lm.coef > 0 it also stores batch['lm_mask']: loss_mask on the rows whose reward is at
    least cfg.positive_lm.threshold (the rewards as the estimator saw them: after reward shaping)."""
    batch.meta.pop("reward_kl", None)
    advantages = ADVANTAGES.get(cfg.advantage)(batch, cfg)
    if cfg.kl_in_reward and cfg.kl_coef > 0 and "reward_kl" not in batch.meta:
        raise ValueError(f"algorithm.kl_in_reward is on but advantage estimator '{cfg.advantage}' does not "
                         "use token-level rewards (use gae, reinforce_plus_plus(_baseline) or remax, or "
                         "put the KL in the loss)")
    expected = tuple(batch["loss_mask"].shape)
    if tuple(advantages.shape) != expected:
        raise ValueError(f"advantage estimator '{cfg.advantage}' returned shape {tuple(advantages.shape)}, "
                         f"expected {expected} (the shape of loss_mask)")
    if not torch.isfinite(advantages).all():
        raise ValueError(f"advantage estimator '{cfg.advantage}' returned non-finite values")
    batch["advantages"] = advantages
    if cfg.positive_lm.coef > 0:  # VAPO's positive-example LM loss trains on these tokens (losses.actor_loss)
        positive = batch["rewards"].float() >= cfg.positive_lm.threshold
        batch["lm_mask"] = torch.where(positive[:, None], batch["loss_mask"].float(), 0.0)
    return batch


def group_statistics(rewards: torch.Tensor, group: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: the size, mean and unbiased std of the rewards in its group.

    The std uses Bessel's correction (like `torch.std`, as verl does); for a group of one sample it is 0.
    """
    ids = {}
    index = torch.tensor([ids.setdefault(g, len(ids)) for g in group], device=rewards.device)
    rewards = rewards.float()
    count = torch.zeros(len(ids), device=rewards.device).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(len(ids), device=rewards.device).index_add_(0, index, rewards) / count
    centred = rewards - mean[index]
    sq_sum = torch.zeros(len(ids), device=rewards.device).index_add_(0, index, centred**2)
    std = (sq_sum / (count - 1).clamp(min=1)).sqrt()
    return count[index], mean[index], std[index]


@ADVANTAGES.register("grpo")
def grpo(batch: Batch, cfg: AlgorithmConfig) -> torch.Tensor:
    """GRPO: each reward relative to its group, (r - mean) / (std + eps), or r - mean (Dr. GRPO,
    cfg.norm_adv_by_std=False). A sample alone in its group has no baseline to compare with: its
    advantage is 0 (r - mean is exactly 0), so it contributes no policy gradient."""
    rewards, mask = batch["rewards"], batch["loss_mask"]
    _, mean, std = group_statistics(rewards, batch["group"])
    scores = rewards.float() - mean
    if cfg.norm_adv_by_std:
        scores = scores / (std + STD_EPS)
    return scores[:, None] * mask.float()


@ADVANTAGES.register("rloo")
def rloo(batch: Batch, cfg: AlgorithmConfig) -> torch.Tensor:
    """RLOO: each reward minus the mean of the *other* rewards of its group, r - (sum - r) / (n - 1)
    = n / (n - 1) * (r - mean). A sample alone in its group gets 0."""
    rewards, mask = batch["rewards"], batch["loss_mask"]
    count, mean, _ = group_statistics(rewards, batch["group"])
    scores = (rewards.float() - mean) * count / (count - 1).clamp(min=1)
    return scores[:, None] * mask.float()


@ADVANTAGES.register("gpg")
def gpg(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """GPG (Chu et al. 2025): alpha * (r - group mean) / F_norm, F_norm = 1 (or the group's std + eps with
    cfg.gpg.norm_by_std), alpha = B / (B - M) where M counts the samples of groups whose rewards are all equal
    (their advantage is 0): the batch-mean gradient is rescaled to the samples that carry one. Pair it with
    policy_loss=gpg (plain policy gradient, no ratio).

    Convention: the paper's alpha; verl divides B by the number of samples whose *reward* is non-zero. A
    sample alone in its group gets 0 (verl gives it alpha * r)."""
    rewards, mask = batch["rewards"].float(), batch["loss_mask"]
    count, mean, std = group_statistics(rewards, batch["group"])
    informative = ((count > 1) & (std > 0)).sum().item()
    scores = (rewards - mean) * len(rewards) / max(informative, 1)
    if cfg.gpg.norm_by_std:
        scores = scores / (std + STD_EPS)
    return scores[:, None] * mask.float()


@ADVANTAGES.register("opo")
def opo(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """OPO (Hao et al. 2025, on-policy RL with the optimal reward baseline): r minus the length-weighted mean
    reward of its group, b = sum_j l_j r_j / sum_j l_j with l_j the trained response tokens of sample j; no
    std normalisation. Meant for exact on-policy training (one update per step).

    Convention: a sample alone in its group is its own baseline (advantage 0); verl gives it baseline 0."""
    rewards, mask = batch["rewards"].float(), batch["loss_mask"]
    lengths = (mask > 0).sum(-1).float()
    ids = {}
    index = torch.tensor([ids.setdefault(g, len(ids)) for g in batch["group"]], device=rewards.device)
    weighted = torch.zeros(len(ids), device=rewards.device).index_add_(0, index, lengths * rewards)
    total = torch.zeros(len(ids), device=rewards.device).index_add_(0, index, lengths)
    baseline = weighted / total.clamp(min=1)
    return (rewards - baseline[index])[:, None] * mask.float()


@ADVANTAGES.register("grpo_passk")
def grpo_passk(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """Pass@k training as verl's grpo_passk implements it (citing arXiv 2503.19595): in each group only the best
    response learns, with advantage r_max - r_second (divided by the group's std + eps when
    cfg.norm_adv_by_std); the others get 0. Ties: the first best in batch order; equal top rewards give 0.

    Convention: verl's estimator; the general pass@k reward transforms of PKPO (Walder & Karkhanis 2025) are not
    implemented."""
    rewards, mask = batch["rewards"].float(), batch["loss_mask"]
    rows: dict = {}
    for row, g in enumerate(batch["group"]):
        rows.setdefault(g, []).append(row)
    _, _, std = group_statistics(rewards, batch["group"])
    scores = torch.zeros_like(rewards)
    for g, members in rows.items():
        if len(members) < 2:
            raise ValueError(f"advantage estimator 'grpo_passk' needs at least 2 samples per group "
                             f"(rollout.n_samples); group {g!r} has 1")
        group_rewards = rewards[members]
        best = int(group_rewards.argmax())
        second = group_rewards[torch.arange(len(members)) != best].max()
        score = group_rewards[best] - second
        scores[members[best]] = score / (std[members[best]] + STD_EPS) if cfg.norm_adv_by_std else score
    return scores[:, None] * mask.float()


# ---------------------------------------------------------------------------------------------
# Token-level building blocks


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the positions where mask > 0, 0 elsewhere.

    Convention: the unbiased variance (Bessel's correction, as verl's masked_whiten); no mean added back."""
    valid = mask > 0
    count = valid.sum().clamp(min=1)
    mean = torch.where(valid, values, torch.zeros_like(values)).sum() / count
    centred = torch.where(valid, values - mean, torch.zeros_like(values))
    var = (centred**2).sum() / (count - 1).clamp(min=1)
    return centred * torch.rsqrt(var + WHITEN_EPS)


def token_level_rewards(batch: Batch, cfg: AlgorithmConfig, sequence_rewards: Tensor | None = None) -> Tensor:
    """[B, T] rewards: each sequence's reward (batch['rewards'] unless given) on its last response token,
    minus cfg.kl_coef * KL(old_logprobs || ref_logprobs) on every response token when cfg.kl_in_reward
    (then batch.meta['reward_kl'] is the KL's mean per response token). A row without response tokens
    gets nothing: its reward has no token to go to."""
    mask = batch["loss_mask"]
    rewards = (batch["rewards"] if sequence_rewards is None else sequence_rewards).float()
    valid = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, -1).max(-1).values  # -1 for an empty response
    token_rewards = torch.where((positions == last[:, None]) & valid, rewards[:, None],
                                torch.zeros(mask.shape, device=mask.device))
    if cfg.kl_in_reward and cfg.kl_coef > 0:
        if "ref_logprobs" not in batch:
            raise KeyError("algorithm.kl_in_reward with kl_coef > 0 but the batch has no 'ref_logprobs'")
        token_rewards, kl = kl_in_reward(token_rewards, batch["old_logprobs"], batch["ref_logprobs"], mask,
                                         cfg.kl_coef, cfg.kl_estimator, cfg.kl_clamp)
        batch.meta["reward_kl"] = (kl.sum() / valid.sum().clamp(min=1)).item()
    return token_rewards


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over the response tokens (mask > 0), from the last one back; 0 elsewhere."""
    valid = mask > 0
    returns = torch.zeros(token_rewards.shape, device=token_rewards.device)
    running = torch.zeros(token_rewards.shape[0], device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t].float() + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return returns


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
        lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's response tokens:
    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, with V_next = A_next = 0
    after the last response token. Returns (advantages, returns = advantages + values), 0 outside mask.
    `lam` is one number or one per row ([B], VAPO's length-adaptive lambda).

    Convention: positions outside mask are skipped, so V_next is the value at the next *trained* token
    (verl's multi-turn handling); OpenRLHF instead zeroes values and rewards there."""
    valid = mask > 0
    values = values.float()
    lam = torch.as_tensor(lam, dtype=torch.float32, device=values.device)
    advantages = torch.zeros(values.shape, device=values.device)
    next_value = torch.zeros(values.shape[0], device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t].float() + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages[:, t] = torch.where(valid[:, t], advantage, 0.0)
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# Token-level estimators


def length_adaptive_lambda(mask: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda per row, 1 - 1 / (alpha * l) with l the row's trained response tokens,
    so that the TD errors' weights sum alike over short and long responses.

    Convention: clamped to [0, 1] (below l = 1 / alpha the formula goes negative; VAPO's responses are
    thousands of tokens long, alpha = 0.05 reaches 0 at 20 tokens)."""
    length = (mask > 0).sum(-1).clamp(min=1).float()
    return (1 - 1 / (alpha * length)).clamp(0.0, 1.0)


@ADVANTAGES.register("gae")
def gae_estimator(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """PPO with a critic: GAE (cfg.gamma, cfg.lam) over token_level_rewards and batch['values'], whitened over
    the batch's response tokens. Also stores batch['returns'] (the critic's targets, not whitened).

    VAPO's decoupled GAE: the returns come from a GAE pass with cfg.gae.critic_lam (1.0: Monte-Carlo returns,
    unbiased targets) and the advantages from one with the policy's lambda, cfg.lam or, with
    cfg.gae.lam_length_alpha > 0, length_adaptive_lambda per response.

    Convention: advantages are whitened here, as verl does (OpenRLHF normalises them in its replay buffer)."""
    if "values" not in batch:
        raise KeyError("advantage estimator 'gae' needs batch['values'] (a critic's per-token values)")
    mask, values = batch["loss_mask"], batch["values"]
    rewards = token_level_rewards(batch, cfg)
    policy_lam = length_adaptive_lambda(mask, cfg.gae.lam_length_alpha) if cfg.gae.lam_length_alpha > 0 else cfg.lam
    advantages, returns = gae(rewards, values, mask, cfg.gamma, policy_lam)
    critic_lam = cfg.lam if cfg.gae.critic_lam < 0 else cfg.gae.critic_lam
    if cfg.gae.lam_length_alpha > 0 or critic_lam != cfg.lam:
        returns = gae(rewards, values, mask, cfg.gamma, critic_lam)[1]
    batch["returns"] = returns
    return masked_whiten(advantages, mask)


@ADVANTAGES.register("reinforce_plus_plus")
def reinforce_plus_plus(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """REINFORCE++ (Hu 2025): discounted returns (cfg.gamma) of token_level_rewards, whitened over the batch's
    response tokens (the batch is the baseline; no critic, no groups)."""
    mask = batch["loss_mask"]
    return masked_whiten(discounted_returns(token_level_rewards(batch, cfg), mask, cfg.gamma), mask)


@ADVANTAGES.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """REINFORCE++-baseline: each reward minus its group's mean, then as reinforce_plus_plus (token rewards
    with the KL penalty when in the reward, discounted returns, batch whitening).

    Convention: a sample alone in its group is centred on itself (score 0, as OpenRLHF); verl leaves its
    reward uncentred. With gamma = 1 and no KL this is verl's rf-baseline estimator."""
    _, mean, _ = group_statistics(batch["rewards"], batch["group"])
    centred = batch["rewards"].float() - mean
    mask = batch["loss_mask"]
    return masked_whiten(discounted_returns(token_level_rewards(batch, cfg, centred), mask, cfg.gamma), mask)


@ADVANTAGES.register("remax")
def remax(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """ReMax (Li et al. 2023): the reward-to-go of token_level_rewards minus the reward of the greedy response
    to the same prompt, batch['baseline_rewards'] [B] (the trainer generates and scores it). Undiscounted
    and not whitened, as in the paper and verl; without KL in the reward every token gets r - r_greedy."""
    if "baseline_rewards" not in batch:
        raise KeyError("advantage estimator 'remax' needs batch['baseline_rewards'] (the greedy response's reward)")
    mask = batch["loss_mask"]
    reward_to_go = discounted_returns(token_level_rewards(batch, cfg), mask, 1.0)
    baseline = batch["baseline_rewards"].float()[:, None]
    return torch.where(mask > 0, reward_to_go - baseline, torch.zeros_like(reward_to_go))


@ADVANTAGES.register("optimal_token_baseline")
def optimal_token_baseline(batch: Batch, cfg: AlgorithmConfig) -> Tensor:
    """The optimal token baseline (verl's OTB): G_t - B_t, with G_t the reward-to-go of token_level_rewards
    and a baseline per response position and group, B_t = sum_i G_i,t W_i,t / sum_i W_i,t over the group's
    responses that reach position t. W_t = sum_{j<=t} (1 - 2 p_j + sum_v p(v)^2) accumulates the squared norm
    of the log-prob gradient w.r.t. the logits along the response (p_j: the sampled token's probability under
    the old policy, batch['old_logprobs']; sum_v p(v)^2: batch['sum_pi_squared'], from the trainer's forward).
    Not whitened. With cfg.otb.zero_tail, the positions of a group's (unique) longest response past the end
    of the second longest get baseline 0 (there it would be its own return: advantage 0).

    Conventions: positions are columns (rows of one group share their prompt, so a column is the same response
    position in each), and a response's end is its last trained token; a sample alone in its group is its own
    baseline (advantage 0), where verl gives it none."""
    for key in ("old_logprobs", "sum_pi_squared"):
        if key not in batch:
            raise KeyError(f"advantage estimator 'optimal_token_baseline' needs batch['{key}']")
    mask = batch["loss_mask"]
    valid = mask > 0
    returns = discounted_returns(token_level_rewards(batch, cfg), mask, 1.0)
    energy = 1 - 2 * batch["old_logprobs"].float().exp() + batch["sum_pi_squared"].float()
    cumulative = torch.where(valid, energy, torch.zeros_like(energy)).cumsum(-1)
    weights = torch.where(valid, cumulative, torch.zeros_like(cumulative))
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    ends = torch.where(valid, positions + 1, 0).max(-1).values  # one past each response's last trained token
    rows: dict = {}
    for row, g in enumerate(batch["group"]):
        rows.setdefault(g, []).append(row)
    baselines = torch.zeros_like(returns)
    for members in rows.values():
        index = torch.tensor(members, device=mask.device)
        baseline = (returns[index] * weights[index]).sum(0) / (weights[index].sum(0) + WHITEN_EPS)
        baselines[index] = baseline.expand(len(members), -1)
        if cfg.otb.zero_tail and len(members) > 1:
            group_ends = ends[index].sort(descending=True).values
            if group_ends[0] > group_ends[1]:
                longest = members[int(ends[index].argmax())]
                baselines[longest, int(group_ends[1]):] = 0.0
    return torch.where(valid, returns - baselines, torch.zeros_like(returns))
