"""Reward functions: `fn(response: str, answer: str, sample: dict) -> float`, chosen by name.

`response` is the decoded response without the stop token or padding; `answer` is the example's
reference; `sample` holds the sample's other fields (prompt, group, ...). A reward is a registered
name (`reverse`, `add`, `exact_match`: see megarl/rewards/synthetic.py) or any plain function given
as `package.module:function`. `score` applies one to a batch and never lets a failing reward end a
run: a reward that raises (or returns a non-finite value) scores 0 and is counted.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from megarl.protocol import Batch
from megarl.utils.registry import Registry

RewardFn = Callable[[str, str, dict], float]
REWARDS = Registry("reward")
logger = logging.getLogger(__name__)


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a `package.module:function` path."""
    return REWARDS.get(name)


def score(samples: Batch | list[dict], fn: RewardFn) -> tuple[list[float], int]:
    """Rewards for each sample (fields `response` and `answer`), and how many reward calls failed."""
    if isinstance(samples, Batch):
        fields = samples.non_tensors
        samples = [{k: v[i] for k, v in fields.items()} for i in range(len(samples))]
    rewards, failed = [], 0
    for sample in samples:
        try:
            value = float(fn(sample["response"], sample["answer"], sample))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
        except Exception as e:  # a reward bug in one sample must not kill a long run; it is counted
            if not failed:
                logger.warning("reward %s failed on response %r: %r (scored 0; further failures counted only)",
                               getattr(fn, "__name__", fn), sample.get("response"), e)
            failed += 1
            value = 0.0
        rewards.append(value)
    return rewards, failed


from megarl.rewards import synthetic  # noqa: E402,F401  (registers the built-in rewards)
