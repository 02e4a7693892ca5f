"""Applying a reward to many samples without letting one sample hang, stop or fool the run.

A reward call fails when it raises, returns anything but a finite number (int, float, bool or a numpy or
torch scalar: the string "0.75", None or a list is no reward), runs past `timeout_s`, or has not finished
when the batch's `batch_timeout_s` runs out. A failed sample scores 0; `score` returns the failures with
their samples, so the trainer can count them and stop a run whose reward keeps failing (failures.py).

Where the calls run:

  reward processes  (reward.isolation=process, the default: build_reward puts a reward function in a
                    RewardPool, pool.py) up to num_workers calls at once, each in a worker process that is
                    killed and replaced when its call runs past its limit: a reward stuck inside one C call,
                    which no signal interrupts, costs one sample, not the run.
  one by one        (reward.isolation=none, num_workers=1, main thread) the time limit is a SIGALRM timer:
                    it interrupts Python code that hangs; a call stuck inside C hangs the run.
  threads           (reward.isolation=none, num_workers > 1 or off the main thread) up to num_workers calls at
                    once; a call past its limit is abandoned, its thread left to end on its own.
  their own way     a reward object with `run_calls(samples, timeout_s, num_workers, deadline)` (a RewardPool;
                    RemoteReward, whose threads stop calling a server that keeps timing out) returns one
                    outcome per sample: a number or the exception that failed it.
  one call          a reward object with `score_batch(samples) -> list` (a reward model) is called once for
                    all samples; if it raises, every sample fails.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import signal
import threading
import time
from typing import Callable, NamedTuple

logger = logging.getLogger(__name__)


class RewardTimeout(Exception):
    """A reward call ran past its time limit, or its batch's."""


class RewardValueError(TypeError):
    """A reward call returned something other than a finite number."""


class RewardCallError(Exception):
    """A reward call failed in a reward process; the message is the error's own text (type: message (where))."""


class RewardFailure(NamedTuple):
    index: int  # in the batch
    sample: dict
    error: BaseException

    def describe(self) -> str:
        """The error's own text and the sample it failed on."""
        fields = ", ".join(f"{key}={excerpt(self.sample.get(key))}" for key in ("prompt", "response", "answer")
                           if key in self.sample)
        return f"{error_text(self.error)} on sample {self.index} ({fields})"


class Scores(NamedTuple):
    rewards: list[float]  # a failed sample's is 0.0
    failures: list[RewardFailure]  # in sample order

    @property
    def failed(self) -> int:
        return len(self.failures)


def error_text(error: BaseException) -> str:
    return str(error) if isinstance(error, RewardCallError) else f"{type(error).__name__}: {error}"


def excerpt(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# megarl.protocol.IMAGE_INPUTS (this module imports no torch): a row's image tensors are the model's inputs; they
# stay out of the samples (a reward process would receive a copy of them, for nothing)
MODEL_INPUTS = ("pixel_values", "image_grid_thw")


def as_samples(samples) -> list[dict]:
    """A Batch's rows as dicts of its non-tensor fields but the model's image inputs (duck-typed: this module must
    not import torch, so reward processes start fast), or a list of dicts as it is."""
    if hasattr(samples, "non_tensors"):
        fields = {k: v for k, v in samples.non_tensors.items() if k not in MODEL_INPUTS}
        return [{k: v[i] for k, v in fields.items()} for i in range(len(samples))]
    return samples


def reward_value(value) -> float:
    """`value` as a reward, or RewardValueError: a number (int, float, bool, numpy or torch scalar), finite."""
    if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == () and hasattr(value, "item"):
        value = value.item()  # a numpy or torch scalar (a 0-d array or tensor), known without importing either
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"reward returned {type(value).__name__} {excerpt(value, 100)}; expected a number "
                               "(int, float, bool, or a numpy or torch scalar)")
    if not math.isfinite(value):
        raise RewardValueError(f"reward returned {value}")
    return float(value)


def call_reward(fn: Callable, sample: dict) -> float:
    return reward_value(fn(sample["response"], sample["answer"], sample))


def call_timeout(timeout_s: float) -> RewardTimeout:
    return RewardTimeout(f"reward call ran past reward.timeout_s={timeout_s:g} s")


def batch_timeout(started: bool) -> RewardTimeout:
    return RewardTimeout(f"reward call {'not finished' if started else 'not started'} when the batch ran past "
                         "reward.batch_timeout_s")


def score(samples, fn: Callable, timeout_s: float | None = None, num_workers: int = 1,
          batch_timeout_s: float | None = None) -> Scores:
    """Rewards for each sample (fields `response` and `answer`) and the failed calls.

    `timeout_s`: limit of one call, `batch_timeout_s`: of all of them (None or 0: none);
    `num_workers`: calls at once."""
    samples = as_samples(samples)
    deadline = time.monotonic() + batch_timeout_s if batch_timeout_s else None
    outcomes = call_all(samples, fn, timeout_s, max(1, num_workers), deadline)
    rewards, failures = [], []
    for i, (sample, outcome) in enumerate(zip(samples, outcomes)):
        if isinstance(outcome, BaseException):
            failures.append(RewardFailure(i, sample, outcome))
            outcome = 0.0
        rewards.append(outcome)
    if failures:
        logger.warning("reward %s failed on %d of %d samples (scored 0); the first: %s",
                       getattr(fn, "__name__", fn), len(failures), len(samples), failures[0].describe())
    return Scores(rewards, failures)


def call_all(samples: list[dict], fn: Callable, timeout_s: float | None, num_workers: int,
             deadline: float | None) -> list:
    """One outcome per sample: its reward, or the exception that failed it (the module docstring says where the
    calls run)."""
    if hasattr(fn, "score_batch"):
        return _score_batch(samples, fn)
    if hasattr(fn, "run_calls"):
        return fn.run_calls(samples, timeout_s, num_workers, deadline)
    if num_workers == 1 and threading.current_thread() is threading.main_thread():
        return _run_one_by_one(samples, fn, timeout_s, deadline)
    return run_threads(samples, lambda sample: call_reward(fn, sample), timeout_s, num_workers, deadline)


def _score_batch(samples: list[dict], fn) -> list:
    try:
        values = list(fn.score_batch(samples))
        if len(values) != len(samples):
            raise ValueError(f"score_batch returned {len(values)} rewards for {len(samples)} samples")
    except Exception as e:
        return [e] * len(samples)
    outcomes = []
    for value in values:
        try:
            outcomes.append(reward_value(value))
        except RewardValueError as e:
            outcomes.append(e)
    return outcomes


def _run_one_by_one(samples: list[dict], fn: Callable, timeout_s: float | None, deadline: float | None) -> list:
    outcomes: list = []
    for sample in samples:
        left = deadline - time.monotonic() if deadline else None
        if left is not None and left <= 0:
            outcomes.append(batch_timeout(started=False))
            continue
        if left is not None and (not timeout_s or left < timeout_s):  # the batch's limit comes first
            limit = (left, batch_timeout(started=True))
        else:
            limit = (timeout_s, call_timeout(timeout_s)) if timeout_s else (None, None)
        try:
            with _alarm(*limit):
                outcomes.append(call_reward(fn, sample))
        except Exception as e:  # a reward bug in one sample must not kill a long run; it is counted
            outcomes.append(e)
    return outcomes


@contextlib.contextmanager
def _alarm(seconds: float | None, error: RewardTimeout | None):
    """Raise `error` in this (main) thread after `seconds`."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise error

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_threads(samples: list[dict], call: Callable[[dict], float], timeout_s: float | None, num_workers: int,
                deadline: float | None) -> list:
    """`call` on each sample in its own daemon thread, at most num_workers running; the clock of a call starts
    when it does. A call past its limit, or running when the batch's deadline passes, is abandoned."""
    outcomes: list = [None] * len(samples)
    finished = threading.Condition()
    done: set[int] = set()

    def run(i: int) -> None:
        try:
            outcome = call(samples[i])
        except Exception as e:
            outcome = e
        with finished:
            if i not in done:  # a call that already timed out keeps its RewardTimeout
                outcomes[i] = outcome
                done.add(i)
            finished.notify()

    running: dict[int, float] = {}  # sample -> when its call started
    following = 0
    with finished:
        while following < len(samples) or running:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                for i in [i for i in running if i not in done] + list(range(following, len(samples))):
                    outcomes[i] = batch_timeout(started=i in running)
                    done.add(i)
                break
            while following < len(samples) and len(running) < num_workers:
                running[following] = now
                threading.Thread(target=run, args=(following,), daemon=True, name=f"reward-{following}").start()
                following += 1
            for i, started in list(running.items()):
                if i in done:
                    del running[i]
                elif timeout_s and now - started >= timeout_s:
                    outcomes[i] = call_timeout(timeout_s)
                    done.add(i)
                    del running[i]
            if running and not any(i in done for i in running):
                ends = [started + timeout_s for started in running.values()] if timeout_s else []
                ends += [deadline] if deadline is not None else []
                finished.wait(timeout=max(min(ends) - now, 0.001) if ends else None)
    return outcomes
