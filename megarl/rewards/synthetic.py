"""Rewards of the built-in synthetic tasks (megarl/data/tasks.py), registered under the task names.

Both give partial credit so that the responses of one GRPO group score differently even before
the policy solves the task (a group that all scores 0 has no learning signal):

  reverse       1.0 for the exact reversed string; otherwise the share of positions where the
                response has the right character, over the longer of the two lengths (so missing or
                extra characters cost as much as wrong ones). "dcba" vs "dcba" = 1.0, "dcbx" = 0.75,
                "dcbaa" = 0.8, "" = 0.0.
  add, mul      1.0 when the response is the sum (product) (surrounding spaces ignored); otherwise half
                the positional digit credit above, so any wrong answer scores below 0.5:
                "357" vs "357" = 1.0, "358" = 0.33, "35" = 0.33, "abc" = 0.0.
  exact_match   1.0 when the stripped response equals the stripped answer, else 0.0.
"""

from __future__ import annotations

from megarl.rewards import REWARDS


def positional_match(response: str, answer: str) -> float:
    """Share of positions with the same character, over the longer length (1.0 only for equal strings)."""
    longest = max(len(response), len(answer))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, answer)) / longest


@REWARDS.register("reverse")
def reverse_reward(response: str, answer: str, sample: dict) -> float:
    return positional_match(response, answer)


@REWARDS.register("mul")
@REWARDS.register("add")
def add_reward(response: str, answer: str, sample: dict) -> float:
    response = response.strip()
    if response == answer.strip():
        return 1.0
    return 0.5 * positional_match(response, answer.strip())


@REWARDS.register("exact_match")
def exact_match(response: str, answer: str, sample: dict) -> float:
    return float(response.strip() == answer.strip())
