"""Advantage estimators and losses: registries users extend with plain functions."""

from megarl.algorithms.advantages import ADVANTAGES, compute_advantages
from megarl.algorithms.dapo import dynamic_sampling_filter, overlong_reward_shaping
from megarl.algorithms.kl import AdaptiveKLController, FixedKLController, kl_controller, kl_in_reward, kl_penalty
from megarl.algorithms.losses import AGGREGATIONS, POLICY_LOSSES, actor_loss, aggregate, sft_loss
from megarl.algorithms import loss_variants  # noqa: F401  (registers gpg, gmpo, cispo, sapo, clip_cov, kl_cov)
from megarl.config import AlgorithmConfig, ConfigError
from megarl.utils.registry import UnknownNameError

__all__ = ["ADVANTAGES", "AGGREGATIONS", "POLICY_LOSSES", "AdaptiveKLController", "FixedKLController",
           "actor_loss", "aggregate", "compute_advantages", "dynamic_sampling_filter", "kl_controller",
           "check_registry_names", "kl_in_reward", "kl_penalty", "overlong_reward_shaping", "sft_loss"]


def check_registry_names(cfg: AlgorithmConfig) -> None:
    """algorithm.advantage, policy_loss and loss_agg must name a registered entry or be a 'module:function' path
    (imported where it is first used). Checked when a run starts: the registries would otherwise refuse an unknown
    name only at the first update, inside a worker, after the warm start and the first rollout."""
    for key, name, registry in (("algorithm.advantage", cfg.advantage, ADVANTAGES),
                                ("algorithm.policy_loss", cfg.policy_loss, POLICY_LOSSES),
                                ("algorithm.loss_agg", cfg.loss_agg, AGGREGATIONS)):
        if ":" not in name and name not in registry:
            try:
                registry.get(name)
            except UnknownNameError as e:
                raise ConfigError(f"{key}={name!r}: {e}") from None
