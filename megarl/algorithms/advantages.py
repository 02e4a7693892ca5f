"""Advantage estimators: `fn(batch, cfg) -> Tensor [B, T]`, registered in `ADVANTAGES`.

An estimator reads the scored batch (`rewards` [B], `group` [B] prompt ids, `loss_mask` [B, T]) and
returns per-token advantages, zero wherever `loss_mask` is 0. Users add their own with
`@ADVANTAGES.register("name")` or name one as `algorithm.advantage=my_pkg.mod:fn`.
"""

from __future__ import annotations

import torch

from megarl.config import AlgorithmConfig
from megarl.protocol import Batch
from megarl.utils.registry import Registry

ADVANTAGES = Registry("advantage estimator")

STD_EPS = 1e-6  # keeps (r - mean) / (std + eps) finite when every reward of a group is equal


def compute_advantages(batch: Batch, cfg: AlgorithmConfig) -> Batch:
    """Run the configured estimator and store its result as batch['advantages']."""
    advantages = ADVANTAGES.get(cfg.advantage)(batch, cfg)
    expected = tuple(batch["loss_mask"].shape)
    if tuple(advantages.shape) != expected:
        raise ValueError(f"advantage estimator '{cfg.advantage}' returned shape {tuple(advantages.shape)}, "
                         f"expected {expected} (the shape of loss_mask)")
    if not torch.isfinite(advantages).all():
        raise ValueError(f"advantage estimator '{cfg.advantage}' returned non-finite values")
    batch["advantages"] = advantages
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
