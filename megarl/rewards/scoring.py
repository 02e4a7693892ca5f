"""Applying a reward to many samples without letting one sample stop the run.

A reward call that raises, returns a non-finite value or runs past `timeout_s` scores 0 and is
counted as failed. Two ways to run the calls:

  one by one    (num_workers=1, called from the main thread, as the driver does) the time limit is a
                SIGALRM timer: it interrupts a Python computation that hangs (a pathological sympy
                simplification in the math reward), so nothing is left running.
  threads       (num_workers > 1, or off the main thread) up to num_workers calls at once, for rewards
                that wait on I/O (the remote server, sandboxed code). A call past its limit is
                abandoned: its thread is left to end on its own (such rewards bound themselves: HTTP
                timeouts, the sandbox's wall clock), and a new call takes its place.

A reward object with a `score_batch(samples) -> list[float]` method (a reward model, a batched server)
is called once for all samples; if it raises, every sample fails.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


class RewardTimeout(Exception):
    """A reward call ran past its time limit."""


def as_samples(samples) -> list[dict]:
    """A Batch's rows as dicts of its non-tensor fields (duck-typed: this module must not import torch, so
    the math reward's checking process starts fast), or a list of dicts as it is."""
    if hasattr(samples, "non_tensors"):
        fields = samples.non_tensors
        return [{k: v[i] for k, v in fields.items()} for i in range(len(samples))]
    return samples


def score(samples, fn: Callable, timeout_s: float | None = None,
          num_workers: int = 1) -> tuple[list[float], int]:
    """Rewards for each sample (fields `response` and `answer`), and how many reward calls failed.

    `timeout_s`: limit of one call (None or 0: none); `num_workers`: calls at once (threads)."""
    samples = as_samples(samples)
    if hasattr(fn, "score_batch"):
        return _score_batch(samples, fn)
    outcomes = [None] * len(samples)
    if num_workers <= 1 and threading.current_thread() is threading.main_thread():
        for i, sample in enumerate(samples):
            try:
                with _alarm(timeout_s):
                    outcomes[i] = _call(fn, sample)
            except Exception as e:  # a reward bug in one sample must not kill a long run; it is counted
                outcomes[i] = e
    else:
        outcomes = _run_threads(samples, fn, timeout_s, max(1, num_workers))
    rewards, failed = [], 0
    for sample, outcome in zip(samples, outcomes):
        if isinstance(outcome, Exception):
            if not failed:
                logger.warning("reward %s failed on response %r: %r (scored 0; further failures counted only)",
                               getattr(fn, "__name__", fn), sample.get("response"), outcome)
            failed += 1
            outcome = 0.0
        rewards.append(outcome)
    return rewards, failed


def _call(fn: Callable, sample: dict) -> float:
    value = float(fn(sample["response"], sample["answer"], sample))
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}")
    return value


def _score_batch(samples: list[dict], fn) -> tuple[list[float], int]:
    try:
        values = [float(v) for v in fn.score_batch(samples)]
        if len(values) != len(samples):
            raise ValueError(f"score_batch returned {len(values)} rewards for {len(samples)} samples")
    except Exception as e:
        logger.warning("batch reward %r failed on %d samples: %r (all scored 0)", fn, len(samples), e)
        return [0.0] * len(samples), len(samples)
    failed = sum(not math.isfinite(v) for v in values)
    return [v if math.isfinite(v) else 0.0 for v in values], failed


@contextlib.contextmanager
def _alarm(timeout_s: float | None):
    """Raise RewardTimeout in this (main) thread after `timeout_s` seconds."""
    if not timeout_s:
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout(f"reward call ran past {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _run_threads(samples: list[dict], fn: Callable, timeout_s: float | None, num_workers: int) -> list:
    """Each call in its own daemon thread, at most num_workers running; the clock of a call starts when it does."""
    outcomes: list = [None] * len(samples)
    finished = threading.Condition()
    done: set[int] = set()

    def run(i: int) -> None:
        try:
            outcome = _call(fn, samples[i])
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
            while following < len(samples) and len(running) < num_workers:
                running[following] = time.monotonic()
                threading.Thread(target=run, args=(following,), daemon=True, name=f"reward-{following}").start()
                following += 1
            now = time.monotonic()
            for i, started in list(running.items()):
                if i in done:
                    del running[i]
                elif timeout_s and now - started >= timeout_s:
                    outcomes[i] = RewardTimeout(f"reward call ran past {timeout_s:g} s")
                    done.add(i)
                    del running[i]
            if running and not any(i in done for i in running):
                deadlines = [started + timeout_s - now for started in running.values()] if timeout_s else [None]
                finished.wait(timeout=max(min(deadlines), 0.001) if timeout_s else None)
    return outcomes
