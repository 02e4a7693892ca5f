"""A reward model's scores in RL: normalised, then mixed with the rule reward (reward_model.normalize, weight,
rule_weight, missing_eos_penalty).

  reward = weight * normalise(score - missing_eos_penalty * [the response did not end with EOS])
           + rule_weight * rule reward

  none      the score as the model gives it
  running   (score - mean) / (std + eps) over every score seen so far, this step's included (so the first step is
            normalised by its own scores): keeps a drifting or badly scaled model's scores near 0 +- 1 across
            steps; the moments go into checkpoints, so a resumed run normalises as the uninterrupted one
  group     (score - mean) / (std + eps) within the prompt's group of samples (as GRPO's advantages are): only
            the order within a group is kept, on the scale of a rule reward it is mixed with

With rule_weight = 0 the rule reward only logs (train/rule_reward): a policy trained on the model's score alone,
measured by a reward it never saw. A reward model trained on finished responses has never seen one cut at the length
limit and may score it high; measured on the CPU pipeline (docs/benchmarks.md), a policy then stops ending its
responses and the rule reward collapses: missing_eos_penalty (TRL's) makes unfinished responses the worst.
"""

from __future__ import annotations

import math

import torch

from megarl.algorithms.advantages import STD_EPS, group_statistics
from megarl.protocol import Batch


class RunningMoments:
    """Count, mean and variance of every value seen, updated one batch at a time (Chan et al.'s pairwise
    update, in float64): the same as the moments of all the values at once."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # m2: the sum of squared deviations from the mean

    def update(self, values: torch.Tensor) -> None:
        values = values.double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.mean().item()
        batch_m2 = ((values - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """The unbiased standard deviation (Bessel's correction, like torch.std); 0 for fewer than two values."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def normalize_group(scores: torch.Tensor, groups: list) -> torch.Tensor:
    """(score - group mean) / (group std + eps), the std unbiased; 0 for a sample alone in its group."""
    _, mean, std = group_statistics(scores, groups)
    return (scores.float() - mean) / (std + STD_EPS)


def rule_agreement(scores: torch.Tensor, rule: torch.Tensor, groups: list) -> float:
    """Of the pairs of samples of one group whose rule rewards differ, the share the reward model orders as the rule
    does (a tie counts half); NaN when no group has such a pair. Near 0.5: the model's preferences say nothing of
    the rule's, and RL on them cannot raise it."""
    order: dict = {}
    ids = torch.tensor([order.setdefault(g, len(order)) for g in groups])
    same = ids[:, None] == ids[None, :]
    rule_above = (rule[:, None] > rule[None, :]) & same
    if not rule_above.any():
        return float("nan")
    diff = scores[:, None] - scores[None, :]
    return ((diff > 0).float() + 0.5 * (diff == 0).float())[rule_above].mean().item()


def ends_with(batch: Batch, token_id: int) -> torch.Tensor:
    """Whether each row's last real token (attention_mask) is `token_id` [B] bool."""
    last = batch["attention_mask"].sum(1) - 1
    return batch["tokens"][torch.arange(len(last)), last.clamp(min=0)] == token_id


class ScoreMixer:
    """The step's rewards from the reward model's scores and the rule rewards (module docstring)."""

    def __init__(self, normalize: str = "none", weight: float = 1.0, rule_weight: float = 0.0,
                 missing_eos_penalty: float = 0.0):
        if normalize not in ("none", "running", "group"):
            raise ValueError(f"normalize={normalize!r}: expected none, running or group")
        self.normalize, self.weight, self.rule_weight = normalize, weight, rule_weight
        self.missing_eos_penalty = missing_eos_penalty
        self.moments = RunningMoments()

    @classmethod
    def from_config(cls, reward_model) -> "ScoreMixer":
        return cls(reward_model.normalize, reward_model.weight, reward_model.rule_weight,
                   reward_model.missing_eos_penalty)

    def __call__(self, scores: torch.Tensor, rule: torch.Tensor, groups: list,
                 ended: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """(rewards, metrics): the mixed rewards [B] float32, and the raw scores' and the rule's means. `ended`:
        which responses ended with EOS (None: all)."""
        raw = scores.float()
        ended = torch.ones_like(raw, dtype=torch.bool) if ended is None else ended
        scores = raw - self.missing_eos_penalty * (~ended).float()
        if self.normalize == "running":
            self.moments.update(scores)
            normalized = (scores - self.moments.mean) / (self.moments.std + STD_EPS)
        elif self.normalize == "group":
            normalized = normalize_group(scores, groups)
        else:
            normalized = scores
        rewards = self.weight * normalized + self.rule_weight * rule.float()
        metrics = {"train/rule_reward": rule.float().mean().item(), "train/rm_score": raw.mean().item(),
                   "train/rm_score_std": raw.std().item() if len(raw) > 1 else 0.0,
                   "train/unfinished": (~ended).float().mean().item(),
                   "train/rm_rule_agreement": rule_agreement(scores, rule.float(), groups)}
        if self.normalize == "running":
            metrics |= {"train/rm_running_mean": self.moments.mean, "train/rm_running_std": self.moments.std}
        return rewards.float(), metrics

    def state_dict(self) -> dict:
        return {"moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.moments.load_state_dict(state["moments"])
