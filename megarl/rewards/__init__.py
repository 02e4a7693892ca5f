"""Reward functions: `fn(response: str, answer: str, sample: dict) -> float`, chosen by name.

`response` is the decoded response without the stop token or padding; `answer` is the example's
reference; `sample` holds the sample's other fields (prompt, group, and for multi-turn rollouts `trajectory`:
every turn, tool call and tool result). A reward is a registered
name or any plain function given as `package.module:function`:

  reverse, add, mul, exact_match   the built-in synthetic tasks (synthetic.py)
  tool_answer                 multi-turn: a tool returned the answer, and the final answer (tool_use.py)
  gsm8k, gsm8k_flexible       GSM8K: `#### N` (strict) or the last number (flexible) (gsm8k.py)
  math                        MATH-style answers checked by math-verify (math.py)
  countdown                   an arithmetic expression reaching a target (countdown.py)
  code                        a program run against test cases in the sandbox (code.py)
  remote                      an HTTP reward server, with timeouts and retries (remote.py)

A reward function runs in reward processes that are killed and replaced when a call runs past its
limit (reward.isolation=process, pool.py), or in the driver's process (reward.isolation=none).

Rewards with settings (remote, code) are built from the RewardConfig by a function registered in
REWARD_BUILDERS; they bound their own calls (HTTP timeouts, the sandbox's wall clock), keep state across
calls, and run in the driver's process whatever reward.isolation says. A builder is also the hook for a
reward model served by a training engine role: it returns an object with `score_batch(samples)`, which
`score` calls once per batch. `score` (scoring.py) applies a reward to a batch and never lets a failing
reward end a run by itself: a call that raises, returns anything but a finite number or times out scores 0
and is returned as a failure; the trainer stops a run whose failures pass reward.max_failure_rate
(failures.py).
"""

from __future__ import annotations

from typing import Callable

from megarl.utils.registry import Registry

RewardFn = Callable[[str, str, dict], float]
REWARDS = Registry("reward")
REWARD_BUILDERS = Registry("reward builder")  # name -> fn(RewardConfig) -> reward, for rewards with settings


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a `package.module:function` path."""
    return REWARDS.get(name)


def build_reward(cfg, default: str = ""):
    """The reward a RewardConfig names (`default` when cfg.name is empty): a builder's product, or a function
    (in a RewardPool with reward.isolation=process)."""
    name = cfg.name or default
    if name in REWARD_BUILDERS:
        return REWARD_BUILDERS.get(name)(cfg)
    fn = REWARDS.get(name)
    return RewardPool(fn, name) if cfg.isolation == "process" else fn


from megarl.rewards.pool import RewardPool  # noqa: E402
from megarl.rewards.scoring import Scores, score  # noqa: E402
from megarl.rewards import code, countdown, gsm8k, math, remote, synthetic, tool_use  # noqa: E402,F401  (registration)

__all__ = ["REWARDS", "REWARD_BUILDERS", "RewardFn", "RewardPool", "Scores", "build_reward", "get_reward_fn", "score"]
