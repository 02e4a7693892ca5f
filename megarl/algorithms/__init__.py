"""Advantage estimators and losses: registries users extend with plain functions."""

from megarl.algorithms.advantages import ADVANTAGES, compute_advantages
from megarl.algorithms.losses import AGGREGATIONS, POLICY_LOSSES, actor_loss, aggregate, kl_penalty, sft_loss

__all__ = ["ADVANTAGES", "AGGREGATIONS", "POLICY_LOSSES", "actor_loss", "aggregate", "compute_advantages",
           "kl_penalty", "sft_loss"]
