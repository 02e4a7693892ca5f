"""DAPO's batch-level extras (Yu et al. 2025), as pure functions the trainer calls after scoring."""

from __future__ import annotations

import torch
from torch import Tensor

from megarl.protocol import Batch


def dynamic_sampling_filter(batch: Batch) -> tuple[Batch, int]:
    """Drop every group (batch['group']) whose rewards are all equal: its group-relative advantages are all
    zero, so it would only dilute the batch. Returns (the kept rows in their order, the number of groups
    dropped); the trainer generates more prompts until it has enough kept groups.

    Convention: a group of one sample is kept (as verl does), so runs with one sample per prompt are not
    emptied; equality is exact (rewards of a rule-based verifier are exact values)."""
    rewards = batch["rewards"].tolist()
    by_group: dict = {}
    for row, group in enumerate(batch["group"]):
        by_group.setdefault(group, []).append(row)
    kept, dropped = [], 0
    for rows in by_group.values():
        values = {rewards[r] for r in rows}
        if len(rows) > 1 and len(values) == 1:
            dropped += 1
        else:
            kept += rows
    return batch.index(sorted(kept)), dropped


def overlong_reward_shaping(response_lengths: Tensor, max_len: int, buffer_len: int,
                            penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment, a reward term per sample: 0 up to max_len - buffer_len tokens, then
    linear down to -penalty_factor at max_len (and -penalty_factor beyond, for lengths past the limit).

    Convention: penalty = -penalty_factor * (L - (max_len - buffer_len)) / buffer_len, as in the DAPO paper
    and verl; the trainer adds it to the task reward."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_reward_shaping needs 0 < buffer_len <= max_len, got buffer_len={buffer_len}, "
                         f"max_len={max_len}")
    excess = (response_lengths.float() - (max_len - buffer_len)).clamp(0, buffer_len)
    return -penalty_factor * excess / buffer_len


def take_groups(batches: list[Batch], n_groups: int) -> tuple[Batch, int]:
    """The step's batch from the generation rounds of dynamic sampling: `n_groups` whole groups, those whose
    rewards differ first (in generation order), then, only when too few of those were generated, groups whose
    rewards are all equal (zero advantage under grpo: they fill the batch to its configured size without
    moving the policy). Returns (the batch, the number of all-equal groups used to fill it).

    Group ids (batch['group']) must be distinct across the batches."""
    batch = Batch.concat(batches)
    informative, _ = dynamic_sampling_filter(batch)
    rows: dict = {}
    for row, group in enumerate(batch["group"]):
        rows.setdefault(group, []).append(row)
    varied = list(dict.fromkeys(informative["group"]))
    filler = [g for g in rows if g not in set(informative["group"])]
    chosen = (varied + filler)[:n_groups]
    if len(chosen) < n_groups:
        raise ValueError(f"take_groups: {len(rows)} groups generated, {n_groups} wanted")
    return batch.index(sorted(r for g in chosen for r in rows[g])), max(0, len(chosen) - len(varied))
