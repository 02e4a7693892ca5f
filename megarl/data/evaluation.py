"""Held-out metrics over k samples per prompt.

  mean@k     the mean reward over every prompt's k samples (averaged over prompts)
  pass@k     the share of prompts with at least one correct sample among their k (correct: reward >=
             `correct_at`, 1.0 by default, i.e. a full-credit answer)
  accuracy   the share of correct samples (with k = 1, the same as pass@1)
"""

from __future__ import annotations

import torch


def eval_metrics(rewards: torch.Tensor, groups: list, correct_at: float = 1.0, prefix: str = "val") -> dict:
    """{prefix/reward, prefix/accuracy, prefix/mean@k, prefix/pass@k}; every group must have k samples."""
    by_group: dict = {}
    for reward, group in zip(rewards.tolist(), groups):
        by_group.setdefault(group, []).append(reward)
    sizes = {len(v) for v in by_group.values()}
    if len(sizes) != 1:
        raise ValueError(f"eval_metrics needs the same number of samples per prompt, got sizes {sorted(sizes)}")
    k = sizes.pop()
    means = [sum(v) / k for v in by_group.values()]
    passed = [any(r >= correct_at for r in v) for v in by_group.values()]
    return {f"{prefix}/reward": rewards.float().mean().item(),
            f"{prefix}/accuracy": (rewards >= correct_at).float().mean().item(),
            f"{prefix}/mean@{k}": sum(means) / len(means),
            f"{prefix}/pass@{k}": sum(passed) / len(passed)}
