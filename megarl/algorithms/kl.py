"""KL to the reference policy: per-token estimators, the KL-in-reward penalty, and the coefficient's controller.

KL enters an algorithm in one of two places (algorithm.kl_in_reward picks): as a loss term
(`actor_loss` adds kl_coef * KL, GRPO-style), or as a per-token penalty subtracted from the rewards
before advantages are estimated (PPO/RLHF-style, used by the GAE and REINFORCE++ estimators).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.config import AlgorithmConfig
from megarl.config.correction_checks import KL_ESTIMATORS

# exp() of a log-ratio above ~88 overflows float32; past 20 the ratio is already 5e8, far outside any
# clip range, so clamping there changes nothing but keeps inf (and then NaN gradients) out.
MAX_LOG_RATIO = 20.0


# verl's estimator names beside Schulman's: kl = k1, mse = k2, low_var_kl = k3 ("full" needs the whole vocabulary)
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clamp: float) -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's estimators), with
    x = lp - ref: k1 = x (unbiased, high variance, can be negative); abs = |x|; k2 = x^2 / 2;
    k3 = exp(-x) + x - 1 (unbiased, always >= 0, low variance), capped at `clamp` (verl's low_var_kl caps at
    10; 0 = no cap): k3 grows like exp(-x), and one token far below the reference would otherwise dominate
    the loss. verl's names kl, mse and low_var_kl are k1, k2 and k3.

    A trailing '+' (k1+, k3+, abs+ ...) is verl's straight-through variant: the value of the named estimator,
    the gradient of k2, (lp - ref) * grad lp, whose expectation is the gradient of KL(policy || reference);
    k1's and k3's expected gradients are not (Schulman 2020). k2+ is k2."""
    straight_through = estimator.endswith("+")
    name = KL_ALIASES.get(estimator.removesuffix("+"), estimator.removesuffix("+"))
    x = (logprobs.float() - ref_logprobs.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if name == "k1":
        value = x
    elif name == "abs":
        value = x.abs()
    elif name == "k2":
        value = 0.5 * x**2
    elif name == "k3":
        value = torch.exp(-x) + x - 1
        value = value.clamp(max=clamp) if clamp > 0 else value
    else:
        raise ValueError(f"unknown KL estimator '{estimator}': must be one of {', '.join(KL_ESTIMATORS)}, "
                         "each optionally with a trailing '+'")
    if not straight_through or name == "k2":
        return value
    k2 = 0.5 * x**2
    return k2 - k2.detach() + value.detach()


def kl_in_reward(token_rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kl_coef: float,
                 estimator: str, clamp: float) -> tuple[Tensor, Tensor]:
    """token_rewards - kl_coef * KL per response token; returns (penalised rewards, the per-token KL),
    both 0 outside `mask`.

    Convention: `logprobs` are the behaviour policy's log-probs recomputed by the trainer ('old_logprobs',
    as verl does), not the rollout engine's."""
    kl = torch.where(mask > 0, kl_penalty(logprobs, ref_logprobs, estimator, clamp), torch.zeros_like(token_rewards))
    return torch.where(mask > 0, token_rewards.float() - kl_coef * kl, torch.zeros_like(kl)), kl


class FixedKLController:
    """A constant KL coefficient (the same interface as AdaptiveKLController)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Steers the KL coefficient so the measured KL tracks `target` (Ziegler et al. 2019, sec. 2.2):
    error = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon.

    `n_steps` is the number of samples the KL was measured on (the paper's batch size), so `horizon` is
    counted in samples. Checkpoint the coefficient with state_dict / load_state_dict."""

    MAX_ERROR = 0.2

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs init_kl_coef, target and horizon > 0, got "
                             f"{init_kl_coef}, {target}, {horizon}")
        super().__init__(init_kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1, -self.MAX_ERROR), self.MAX_ERROR)
        self.value *= 1 + error * n_steps / self.horizon
        return self.value


def kl_controller(cfg: AlgorithmConfig) -> FixedKLController:
    """The configured controller: adaptive when algorithm.kl_target > 0, else the fixed kl_coef.

    The trainer owns it: it passes `dataclasses.replace(cfg, kl_coef=ctl.value)` to compute_advantages /
    actor_loss, then calls `ctl.update(batch.meta['reward_kl'], len(batch))` (or the loss's 'kl' metric)."""
    if cfg.kl_target > 0:
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(cfg.kl_coef)
