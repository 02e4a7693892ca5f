"""The reward a config names, called as megarl calls a reward whichever convention it was written for, and the check
of it before a run starts (check_reward).

A function is called by the convention its signature shows, read once when it is loaded:

  verl's     parameters named data_source, solution_str or ground_truth, as verl's custom_reward_function:
             compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict.
             It gets, by keyword, the row's data_source (None where the row has none), the decoded response, the
             row's answer (verl's reward_model.ground_truth) and the row's extra_info ({} where the row has none):
             each it names, or all four where it takes **kwargs. A dict return counts its "score"; its other keys
             (verl logs them as metrics) are not kept.
  megarl's   fn(response, answer, sample) -> float: any three positional parameters (rewards/__init__.py).

Any other signature (two parameters, a required keyword-only one, a required parameter verl does not pass) is a
ConfigError naming the config key, the function and both conventions. So is a file that is missing or does not
import (the error and its line), or a function that is not in it.
"""

from __future__ import annotations

import inspect
from typing import Callable

from megarl.config import ConfigError
from megarl.rewards import REWARD_BUILDERS, REWARDS
from megarl.rewards.code import code_tests
from megarl.rewards.data_source import UnknownDataSource, by_data_source, scorer_of
from megarl.rewards.scoring import RewardValueError, error_text, score
from megarl.rewards.worker import portable
from megarl.sandbox.runner import advice, missing_tool
from megarl.utils.registry import FileFunction, UnknownNameError

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
EXPECTED = ("expected verl's compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) or "
            "megarl's fn(response, answer, sample)")
PROMPT_FILES = (".jsonl", ".parquet")


class VerlReward:
    """A function written for verl, called as megarl calls a reward (the module docstring). It pickles with the
    function (by reference, or a file's by its path), so it runs in reward processes as a megarl function does."""

    def __init__(self, fn: Callable, arguments: tuple[str, ...]):
        self.fn, self.arguments = fn, arguments
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, response: str, answer, sample: dict):
        given = {"data_source": sample.get("data_source"), "solution_str": response, "ground_truth": answer,
                 "extra_info": sample.get("extra_info") or {}}
        return verl_score(self.fn(**{name: given[name] for name in self.arguments}))


def verl_score(result):
    """A verl reward's result as a reward: a dict's "score", anything else as it is (`score` checks it is a number)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardValueError(f"reward returned a dict without 'score' (keys: {', '.join(map(str, result))})")
        return result["score"]
    return result


def reward_name(cfg, task: str = "") -> str:
    """The reward a RewardConfig names: reward.name, else a built-in task's own (`task`, data.task) or, for a prompt
    file, each row's data_source (verl's default scorer)."""
    if cfg.name:
        return cfg.name
    return "data_source" if task.endswith(PROMPT_FILES) else task


def reward_function(name: str, key: str = "reward.name") -> Callable:
    """The function `name` names (registered, `package.module:function` or `path/to/file.py:function`), called as
    megarl calls a reward; ConfigError naming `key` when it does not load or its signature is neither convention."""
    try:
        fn = REWARDS.get(name)
    except UnknownNameError as e:
        raise ConfigError(f"{key}={name!r}: {e}, or a 'path/to/file.py:function'") from None
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}={name!r}: {e}") from None
    return as_megarl_reward(fn, name, key)


def as_megarl_reward(fn: Callable, name: str, key: str) -> Callable:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: called as megarl's
        return fn
    parameters = signature.parameters
    verl = bool({"data_source", "solution_str", "ground_truth"} & parameters.keys())
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    arguments = tuple(a for a in VERL_ARGUMENTS if takes_any or a in parameters)
    try:
        signature.bind(**dict.fromkeys(arguments)) if verl else signature.bind("response", "answer", {})
    except TypeError as e:
        raise ConfigError(f"{key}={name!r}: {getattr(fn, '__name__', name)}{signature} cannot be called as "
                          f"{'verl' if verl else 'megarl'}'s convention ({e}); {EXPECTED}") from None
    return VerlReward(fn, arguments) if verl else fn


def describe(fn: Callable, name: str) -> str:
    inner = fn.fn if isinstance(fn, VerlReward) else fn
    what = f"{inner.attr} from {inner.path}" if isinstance(inner, FileFunction) else name
    return f"reward: {what} ({'verl' if isinstance(fn, VerlReward) else 'megarl'} signature)"


def check_reward(cfg, first_row: dict | None = None, key: str = "reward.name") -> str:
    """Import the reward function a Config names and, given the prompt file's first row, call it once on that row
    with an empty response and the row's answer; a one-line description of the reward for the start-up echo.

    Raises ConfigError naming `key` (the config key the reward came from: reward.name, or verl's
    custom_reward_function.path) when the file is missing or does not import (the error and its line), the function
    is not there, its signature is neither convention, the call on the first row raises or returns no finite number,
    or (the reward following data_source) the first row's data_source has no built-in scorer. Builders (remote, code,
    a user's) are described, not built or called: the code reward only reads the first row's tests."""
    r = cfg.reward
    name = reward_name(r, cfg.data.task)
    where = getattr(first_row, "origin", f"{cfg.data.task}, the first row")
    sample = None if first_row is None else first_sample(first_row)
    if name == "data_source":
        line = check_by_data_source(r, sample, where, key)
    elif name in REWARD_BUILDERS:
        line = describe_builder(r, name, sample, where, key)
    else:
        fn = reward_function(name, key)
        if sample is not None:
            call_once(fn, sample, r.timeout_s, where, f"{key}={name!r}")
        line = describe(fn, name)
    m = cfg.reward_model
    if m.path:
        line += (f"; plus the reward model {m.path} (score x {m.weight:g}, normalize={m.normalize}, rule reward x "
                 f"{m.rule_weight:g})")
    return line


def first_sample(row: dict) -> dict:
    """The sample a reward gets for `row` with an empty response."""
    from megarl.data.dataset import record_answer  # torch: only where a row is checked
    from megarl.protocol import REWARD_FIELDS

    return {"group": 0, "prompt": row.get("prompt"), "response": "", "answer": record_answer(row)} | {
        k: row.get(k) for k in REWARD_FIELDS}


def call_once(fn: Callable, sample: dict, timeout_s: float, where: str, what: str) -> None:
    scores = score([sample], fn, timeout_s or None)
    if scores.failures:
        error = scores.failures[0].error
        raise ConfigError(f"{what}: the call on {where} with an empty response failed: "
                          f"{error_text(portable(error))}") from error


def check_by_data_source(r, sample: dict | None, where: str, key: str) -> str:
    if sample is None:
        return "reward: by each row's data_source (verl's default scorer)"
    source = sample["data_source"]
    named = f"{key}={r.name!r}" if r.name else f"{key} is empty, so the reward follows each row's data_source"
    try:
        scorer = scorer_of(source)
    except UnknownDataSource as e:
        raise ConfigError(f"{named}: {where}: {e}") from None
    if scorer == "code":
        check_code_sandbox(r)
        check_code_tests(sample, where, f"{named}: data_source {source!r}")
    else:
        call_once(by_data_source, sample, r.timeout_s, where, f"{named}: data_source {source!r} -> {scorer}")
    return f"reward: by data_source ({source} -> {scorer})"


def check_code_sandbox(r) -> None:
    """The code reward's sandbox mode can run here, as far as a look for its program tells (a run's start probes it)."""
    if missing := missing_tool(r.code_sandbox):
        raise ConfigError(f"reward.code_sandbox={r.code_sandbox}: the code reward's sandbox cannot run here ({missing})"
                          f": {advice(r.code_sandbox)}")


def check_code_tests(sample: dict, where: str, what: str) -> None:
    try:
        code_tests(sample["answer"])
    except ValueError as e:
        raise ConfigError(f"{what}: {where}: {e}") from None


def describe_builder(r, name: str, sample: dict | None, where: str, key: str) -> str:
    if name == "remote":
        return (f"reward: remote, a JSON POST per sample to {r.remote_url} ({r.remote_timeout_s:g} s a request, "
                f"{r.remote_retries} retries; not called by the check)")
    if name == "code":
        check_code_sandbox(r)
        if sample is not None:
            check_code_tests(sample, where, f"{key}='code'")
        return (f"reward: code, the response's program against the row's tests in the sandbox ({r.code_sandbox}, "
                f"{r.code_timeout_s:g} s and {r.code_memory_mb} MB a test; not run by the check)")
    return f"reward: {name}, built from the reward config (not called by the check)"
