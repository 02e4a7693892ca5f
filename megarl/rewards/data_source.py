"""The reward each prompt row's `data_source` names, as verl's default scorer (default_compute_score) chooses it: the
reward of a prompt file with no reward.name, or named `reward.name=data_source`.

  openai/gsm8k                                          gsm8k (strict `#### N`, no format credit)
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,   math (math-verify; verl compares normalised boxed strings)
  HuggingFaceH4/MATH-500
  math_dapo, math, math_dapo_reasoning, aime*           math_dapo (`Answer: X`, +1 / -1)
  numina_*                                              math (math-verify; verl uses PRIME's math checker)
  deepmind/math_dataset                                 math (megarl's own: verl has no scorer for it; answers
                                                        such as -13, 0.25, 2/7 compared as numbers)
  codecontests, apps, codeforces, taco                  code (the row's tests in the sandbox, code.py)
  hiyouga/geometry3k                                    geo3k (boxed answer 0.9 + format 0.1)
  searchR1_* (nq, triviaqa, popqa, hotpotqa,            qa_em (exact match of the last <answer>...</answer>)
  2wikimultihopqa, musique, bamboogle)

A row with another data_source, or none, fails its call with an UnknownDataSource naming the source
(reward.max_failure_rate stops a run that keeps meeting them); megarl.rewards.loading.check_reward finds it on the
first row before a run starts. Code rows run in the driver's process, in the sandbox (which bounds each test); the
other rows run as reward.isolation says (in reward processes by default).
"""

from __future__ import annotations

import threading

from megarl.rewards import REWARD_BUILDERS, REWARDS
from megarl.rewards.code import CodeReward, build_code_reward
from megarl.rewards.pool import RewardPool
from megarl.rewards.worker_limits import WorkerLimits
from megarl.rewards.scoring import call_all

SOURCES = {"openai/gsm8k": "gsm8k",
           "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math", "HuggingFaceH4/MATH-500": "math",
           "math_dapo": "math_dapo", "math": "math_dapo", "math_dapo_reasoning": "math_dapo",
           "codecontests": "code", "apps": "code", "codeforces": "code", "taco": "code",
           "hiyouga/geometry3k": "geo3k", "deepmind/math_dataset": "math"}
PREFIXES = {"aime": "math_dapo", "numina_": "math", "searchR1_": "qa_em"}
SET_REWARD = "set reward.name or custom_reward_function.path to score it"


class UnknownDataSource(ValueError):
    """A row whose data_source has no built-in scorer."""


def scorer_of(data_source) -> str:
    """The reward (a registered name) that verl's default scorer gives `data_source`."""
    if isinstance(data_source, str):
        if data_source in SOURCES:
            return SOURCES[data_source]
        for prefix, name in PREFIXES.items():
            if data_source.startswith(prefix):
                return name
    if data_source is None:
        raise UnknownDataSource(f"the row has no data_source for the reward to follow; {SET_REWARD}")
    raise UnknownDataSource(f"data_source {data_source!r} has no built-in scorer (those of verl's "
                            f"default_compute_score: {', '.join(SOURCES)}, aime*, numina_*, searchR1_*); {SET_REWARD}")


def by_data_source(response: str, answer, sample: dict) -> float:
    """The reward of the sample's data_source, for any row but a code row (DataSourceReward scores those)."""
    return REWARDS.get(scorer_of(sample.get("data_source")))(response, answer, sample)


class DataSourceReward:
    """Scores a batch row by row by data_source: code rows in one sandbox (built at the first code row) in this
    process, the rest through `by_data_source` where reward.isolation says."""

    __name__ = "data_source"

    def __init__(self, cfg):
        self.cfg = cfg
        self.rules = (RewardPool(by_data_source, "data_source", WorkerLimits.from_config(cfg))
                      if cfg.isolation == "process" else by_data_source)
        self.code: CodeReward | None = None
        self.lock = threading.Lock()  # one sandbox, however many threads meet code rows first

    def run_calls(self, samples: list[dict], timeout_s: float | None, num_workers: int,
                  deadline: float | None) -> list:
        code = [is_code(sample) for sample in samples]
        outcomes: list = [None] * len(samples)
        for rows, fn in (([i for i, c in enumerate(code) if not c], self.rules),
                         ([i for i, c in enumerate(code) if c], self.score_code)):
            if rows:
                for i, outcome in zip(rows, call_all([samples[i] for i in rows], fn, timeout_s, num_workers, deadline)):
                    outcomes[i] = outcome
        return outcomes

    def score_code(self, response: str, answer, sample: dict) -> float:
        with self.lock:
            if self.code is None:
                self.code = build_code_reward(self.cfg)
        return self.code(response, answer, sample)

    def close(self) -> None:
        if isinstance(self.rules, RewardPool):
            self.rules.close()
        if self.code is not None:
            self.code.close()


def is_code(sample: dict) -> bool:
    try:
        return scorer_of(sample.get("data_source")) == "code"
    except UnknownDataSource:  # fails in by_data_source, naming the source
        return False


@REWARD_BUILDERS.register("data_source")
def build_data_source_reward(cfg) -> DataSourceReward:
    return DataSourceReward(cfg)
