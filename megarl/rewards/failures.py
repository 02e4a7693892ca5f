"""Stopping a run whose reward keeps failing.

`score` never lets a failing reward call end a run: the sample scores 0. But a reward that fails on most
samples (a server that is down, a reward bug, a reference column with the wrong format) turns the run
into training on zeros, which looks like a policy that learns nothing. A RewardFailureTracker counts the
calls and failures of each step (the scoring calls of one step are added, then the step is closed); when
more than `max_rate` of the calls over the last `window` steps (all of them while fewer have run) failed,
closing the step raises RewardFailureError with the first failure's own error and sample.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from megarl.rewards.scoring import RewardFailure, Scores


class RewardFailureError(RuntimeError):
    """Too many reward calls failed: the run stops."""


class StepFailures(NamedTuple):
    step: int
    calls: int
    failed: int
    first: RewardFailure | None


class RewardFailureTracker:
    def __init__(self, max_rate: float, window: int, what: str = "training"):
        self.max_rate, self.what = max_rate, what
        self.steps: deque[StepFailures] = deque(maxlen=window)
        self.calls, self.failed, self.first = 0, 0, None  # the step being scored

    @classmethod
    def from_config(cls, reward_cfg, evaluation: bool = False) -> "RewardFailureTracker":
        """Training's tracker (over reward.failure_window steps), or evaluation's (each evaluation on its own)."""
        if evaluation:
            return cls(reward_cfg.max_failure_rate, 1, "evaluation")
        return cls(reward_cfg.max_failure_rate, reward_cfg.failure_window)

    def add(self, scores: Scores) -> None:
        """One scoring call's outcomes, for the step being scored."""
        self.calls += len(scores.rewards)
        self.failed += scores.failed
        self.first = self.first or (scores.failures[0] if scores.failures else None)

    def forget_after(self, step: int) -> None:
        """Drop the steps after `step` from the window, and the calls of the step not closed yet (a batch cut short):
        a run restarted from that step's checkpoint scores them again (megarl/recovery.py)."""
        self.steps = deque((s for s in self.steps if s.step <= step), maxlen=self.steps.maxlen)
        self.calls, self.failed, self.first = 0, 0, None

    def end_step(self, step: int) -> int:
        """Close the step; returns its failed calls. Raises RewardFailureError when the window's failure rate
        passes max_rate."""
        self.steps.append(StepFailures(step, self.calls, self.failed, self.first))
        self.calls, self.failed, self.first = 0, 0, None
        calls, failed = sum(s.calls for s in self.steps), sum(s.failed for s in self.steps)
        if calls and failed / calls > self.max_rate:
            first = next(s for s in self.steps if s.first is not None)
            steps = f"step {self.steps[0].step}" + (f" to {step}" if len(self.steps) > 1 else "")
            raise RewardFailureError(
                f"{self.what} reward calls failed {failed} of {calls} times in {steps} ({failed / calls:.0%}, more "
                f"than reward.max_failure_rate={self.max_rate:g}); the first, at step {first.step}: "
                f"{first.first.describe()}") from first.first.error
        return self.steps[-1].failed
