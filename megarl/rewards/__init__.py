"""Reward functions: `fn(response: str, answer: str, sample: dict) -> float`, chosen by name.

`response` is the decoded response without the stop token or padding; `answer` is the example's
reference; `sample` holds the sample's other fields (prompt, group, the prompt row's data_source and extra_info, and
for multi-turn rollouts `trajectory`: every turn, tool call and tool result). A reward is a registered
name, any plain function given as `package.module:function`, or one in a file, `path/to/file.py:function` (imported
by its path, in the driver and in each reward process). A function written for verl,
`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` returning a number or a dict
with "score", is called as verl calls it (loading.py reads the convention from its signature):

  reverse, add, mul, exact_match   the built-in synthetic tasks (synthetic.py)
  tool_answer                 multi-turn: a tool returned the answer, and the final answer (tool_use.py)
  gsm8k, gsm8k_flexible       GSM8K: `#### N` (strict) or the last number (flexible) (gsm8k.py)
  math                        MATH-style answers checked by math-verify (math.py)
  math_dapo                   DAPO's: the `Answer: X` line, normalised, +1 or -1 (math_dapo.py)
  geo3k                       Geometry3K: the boxed answer (0.9) and `<think>` format (0.1) (geo3k.py)
  qa_em                       Search-R1: exact match of the last <answer>...</answer> with a target (qa_em.py)
  countdown                   an arithmetic expression reaching a target (countdown.py)
  code                        a program run against test cases in the sandbox (code.py)
  remote                      an HTTP reward server, with timeouts and retries (remote.py)
  data_source                 each row's data_source picks one of the above, as verl's default scorer does
                              (data_source.py); the reward of a prompt file when reward.name is empty

A reward function runs in reward processes that are killed and replaced when a call runs past its
limit or its process's memory or threads pass theirs (reward.isolation=process, pool.py, worker_limits.py), or in
the driver's process (reward.isolation=none).

Rewards with settings (remote, code, data_source) are built from the RewardConfig by a function registered in
REWARD_BUILDERS; remote and code bound their own calls (HTTP timeouts, the sandbox's wall clock), keep state across
calls, and run in the driver's process whatever reward.isolation says. A builder is also the hook for a
reward model served by a training engine role: it returns an object with `score_batch(samples)`, which
`score` calls once per batch. `score` (scoring.py) applies a reward to a batch and never lets a failing
reward end a run by itself: a call that raises, returns anything but a finite number or times out scores 0
and is returned as a failure; the trainer stops a run whose failures pass reward.max_failure_rate
(failures.py). megarl.rewards.loading.check_reward tries the reward on the prompt file's first row before a
run starts.
"""

from __future__ import annotations

from typing import Callable

from megarl.utils.registry import Registry

RewardFn = Callable[[str, str, dict], float]
REWARDS = Registry("reward")
REWARD_BUILDERS = Registry("reward builder")  # name -> fn(RewardConfig) -> reward, for rewards with settings


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a `package.module:function` or `file.py:function` path (as it is written:
    build_reward calls a verl function as verl does)."""
    return REWARDS.get(name)


def build_reward(cfg, task: str = ""):
    """The reward a RewardConfig names (loading.reward_name: with cfg.name empty, the built-in `task`'s own, or each
    row's data_source for a prompt file): a builder's product, or a function called as megarl calls a reward (in a
    RewardPool with reward.isolation=process). A function that does not load is a ConfigError naming reward.name."""
    # here, not at import: loading imports the config layer, which reward processes (importing this package) need not
    from megarl.rewards.loading import reward_function, reward_name

    name = reward_name(cfg, task)
    if name in REWARD_BUILDERS:
        return REWARD_BUILDERS.get(name)(cfg)
    fn = reward_function(name)
    return RewardPool(fn, name, WorkerLimits.from_config(cfg)) if cfg.isolation == "process" else fn


from megarl.rewards.pool import RewardPool  # noqa: E402
from megarl.rewards.scoring import Scores, score  # noqa: E402
from megarl.rewards.worker_limits import WorkerLimits  # noqa: E402
from megarl.rewards import (code, countdown, data_source, geo3k, gsm8k, math, math_dapo,  # noqa: E402,F401
                            qa_em, remote, synthetic, tool_use)  # (registration)

__all__ = ["REWARDS", "REWARD_BUILDERS", "RewardFn", "RewardPool", "Scores", "build_reward", "get_reward_fn", "score"]
