"""MATH-style answers, checked by math-verify: 1.0 when the response's final answer equals the reference
mathematically (`\\frac{1}{2}` = `0.5` = `\\dfrac12`, `3\\sqrt{2}` = `\\sqrt{18}`, `(x+1)^2` = `x^2+2x+1`,
intervals, sets, `90^\\circ` = `90`), else 0.0.

The reference is the bare LaTeX answer (what scripts/preprocess/math.py extracts from a solution's
`\\boxed{}`). From the response math-verify takes a `\\boxed{}` answer first, then the last LaTeX or
plain expression; a response with no answer scores 0.

math-verify runs in a separate process that is killed after MATH_TIMEOUT_S: sympy can spend unbounded
time inside one C call (`\\boxed{9^{9^{9^{9}}}}` builds a number with 10^8 digits), which no signal or
thread can interrupt. A killed check raises RewardTimeout (so `score` counts it as failed) and the
check starts a fresh process; the seconds that takes (sympy's imports) do not count towards the check's
limit, so keep reward.timeout_s (score's limit, which counts everything) well above MATH_TIMEOUT_S.
Idle processes are reused, one per concurrent caller.
"""

from __future__ import annotations

import multiprocessing
import queue

from megarl.rewards import REWARDS
from megarl.rewards.scoring import RewardTimeout

MATH_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 60.0


def _serve(conn) -> None:
    """The checking process: (response, answer) in, True/False or an error message out, until closed."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_config = [LatexExtractionConfig()]
    answer_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    verify(parse("$1$", gold_config, parsing_timeout=None), parse("1", answer_config, parsing_timeout=None),
           timeout_seconds=None)  # the first check loads most of sympy: do it before taking work
    conn.send("ready")
    while True:
        try:
            response, answer = conn.recv()
        except EOFError:
            return
        try:
            gold = parse("\\boxed{" + answer + "}", extraction_config=gold_config, parsing_timeout=None)
            if not gold:
                raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
            predicted = parse(response, extraction_config=answer_config, parsing_timeout=None)
            conn.send(bool(predicted) and bool(verify(gold, predicted, timeout_seconds=None)))
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")


class _Checker:
    """One checking process and the pipe to it."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")  # no fork of a driver that runs threads
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), daemon=True, name="math-verify")
        self.process.start()
        child.close()
        # starting (imports) is not the sample's fault: it has its own limit, the check's starts after it
        try:
            ready = self.conn.poll(STARTUP_TIMEOUT_S) and self.conn.recv() == "ready"
        except BaseException:  # e.g. score's timer went off while waiting: leave no process behind
            self.close()
            raise
        if not ready:
            self.close()
            raise RuntimeError(f"the math-verify process did not start within {STARTUP_TIMEOUT_S:g} s")

    def check(self, response: str, answer: str, timeout_s: float) -> bool:
        self.conn.send((response, answer))
        if not self.conn.poll(timeout_s):
            raise RewardTimeout(f"math-verify ran past {timeout_s:g} s")
        result = self.conn.recv()
        if isinstance(result, str):
            raise ValueError(result)
        return result

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


_idle: queue.SimpleQueue = queue.SimpleQueue()  # processes free for the next check


def math_equal(response: str, answer: str, timeout_s: float | None = None) -> bool:
    """Whether the response's final answer equals `answer` (see the module docstring); the check may take
    `timeout_s` (default MATH_TIMEOUT_S)."""
    try:
        checker = _idle.get_nowait()
    except queue.Empty:
        checker = _Checker()
    finished = False
    try:
        result = checker.check(response, answer, timeout_s or MATH_TIMEOUT_S)
        finished = True
        return result
    except ValueError:
        finished = True  # the process answered with an error; it is still sound
        raise
    finally:
        # a check cut short (its own limit, or score's timer interrupting the wait) leaves the process busy
        if finished:
            _idle.put(checker)
        else:
            checker.close()


@REWARDS.register("math")
def math_reward(response: str, answer: str, sample: dict) -> float:
    return float(math_equal(response, answer))
