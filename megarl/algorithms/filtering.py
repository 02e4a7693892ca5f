"""PF-PPO (Shen et al. 2024, policy filtration for RLHF): train on the samples whose rewards are most
trustworthy. A reward model is least reliable in its middle range, so samples are weighted by reward before
the update, and the step's batch is drawn again in proportion to the weights (or its advantages scaled).

The trainer calls `PolicyFilter` after the advantages (algorithm.pf_ppo.method != none), so the critic and the policy
both train on the filtered batch, as in verl. Weights (verl's modes, `pf_ppo_weights`):
  pow         |r| ** algorithm.pf_ppo.weight_pow
  max_min     1 for the highest and the lowest reward, 0 for the rest (the paper's best-worst)
  max_random  0.4 for the highest reward, 0.1 for the rest (the paper's best-random)
With algorithm.pf_ppo.scope=batch (verl) highest and lowest are the batch's; with group (the paper) each
prompt's. algorithm.pf_ppo.replay keeps the highest-reward samples of earlier steps, with the advantages and
log-probs of their own step (their old log-probs make the PPO ratio an importance weight for the older
policy that generated them), and draws from them beside the step's samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.config.knob_sections import PFPPOConfig
from megarl.protocol import Batch

MODES = ("pow", "max_min", "max_random")
MIN_WEIGHT = 1e-8  # every row stays drawable, as in verl (a batch of zero weights would be undrawable)


def pf_ppo_weights(rewards: Tensor, group: list, mode: str, weight_pow: float, scope: str) -> Tensor:
    """The PF-PPO weight of each sample [B] from its reward, before MIN_WEIGHT is added."""
    rewards = rewards.float()
    if mode == "pow":
        return rewards.abs() ** weight_pow
    if mode not in MODES:
        raise ValueError(f"algorithm.pf_ppo.method={mode!r}: must be one of none, {', '.join(MODES)}")
    if scope == "batch":
        highest, lowest = rewards.max().expand_as(rewards), rewards.min().expand_as(rewards)
    else:  # each prompt's group
        highest, lowest = torch.empty_like(rewards), torch.empty_like(rewards)
        for g in set(group):
            rows = torch.tensor([i for i, x in enumerate(group) if x == g])
            highest[rows], lowest[rows] = rewards[rows].max(), rewards[rows].min()
    if mode == "max_min":
        return ((rewards == highest) | (rewards == lowest)).float()
    return torch.where(rewards == highest, 0.4, 0.1)


class PolicyFilter:
    """Applies algorithm.pf_ppo to each step's batch; holds the replay of high-reward samples and the random
    state of the draws (both in its state_dict, for checkpoints)."""

    def __init__(self, cfg: PFPPOConfig, seed: int):
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(seed)
        self.replay: Batch | None = None
        self.steps = 0  # batches filtered: names the replayed samples' groups

    def __call__(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """(the batch to train on, metrics 'pf_ppo/...')."""
        c = self.cfg
        self.steps += 1
        if not c.resample:
            weights = pf_ppo_weights(batch["rewards"], batch["group"], c.method, c.weight_pow, c.scope) + MIN_WEIGHT
            scale = weights / weights.mean()
            batch["advantages"] = batch["advantages"] * scale[:, None]
            return batch, {"pf_ppo/weight_max": scale.max().item(), "pf_ppo/weight_min": scale.min().item()}
        pool = batch if self.replay is None else Batch.concat([batch, self.replay])
        weights = pf_ppo_weights(pool["rewards"], pool["group"], c.method, c.weight_pow, c.scope) + MIN_WEIGHT
        drawn = torch.multinomial(weights, len(batch), replacement=True, generator=self.generator)
        if c.replay:
            self.replay = self._kept_for_replay(pool)
        chosen = pool.index(drawn)
        return chosen, {"pf_ppo/distinct_rows": len(set(drawn.tolist())) / len(batch),
                        "pf_ppo/replayed_rows": (drawn >= len(batch)).float().mean().item(),
                        "pf_ppo/reward": chosen["rewards"].float().mean().item()}

    def _kept_for_replay(self, pool: Batch) -> Batch:
        """The algorithm.pf_ppo.replay highest-reward rows of the pool (the step's rows first among equal rewards),
        under group ids of their own: a replayed sample is never taken for a member of a later step's group."""
        order = torch.sort(pool["rewards"].float(), descending=True, stable=True).indices[:self.cfg.replay]
        kept = pool.index(order)
        kept["group"] = [g if isinstance(g, tuple) and g[:1] == ("replay",) else ("replay", self.steps, g)
                         for g in kept["group"]]
        return kept

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "replay": self.replay, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.replay, self.steps = state["replay"], state["steps"]
