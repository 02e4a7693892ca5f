"""Advantage estimators and losses: registries users extend with plain functions."""

from megarl.algorithms.advantages import ADVANTAGES, compute_advantages
from megarl.algorithms.dapo import dynamic_sampling_filter, overlong_reward_shaping
from megarl.algorithms.kl import AdaptiveKLController, FixedKLController, kl_controller, kl_in_reward, kl_penalty
from megarl.algorithms.losses import AGGREGATIONS, POLICY_LOSSES, actor_loss, aggregate, sft_loss
from megarl.algorithms import loss_variants  # noqa: F401  (registers gpg, gmpo, cispo, sapo, clip_cov, kl_cov)

__all__ = ["ADVANTAGES", "AGGREGATIONS", "POLICY_LOSSES", "AdaptiveKLController", "FixedKLController",
           "actor_loss", "aggregate", "compute_advantages", "dynamic_sampling_filter", "kl_controller",
           "kl_in_reward", "kl_penalty", "overlong_reward_shaping", "sft_loss"]
