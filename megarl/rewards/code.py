"""Code with test cases: the response's program runs in the sandbox (megarl/sandbox/).

The reference answer is JSON (or, from verl's reward_model.ground_truth, the object itself) in one of two forms:

  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}   stdin/stdout tests (APPS, CodeContests style):
        the program runs once per case with the input on stdin; its stdout must equal the output,
        compared line by line with trailing whitespace and trailing blank lines ignored.
  {"asserts": ["assert add(1, 2) == 3", ...]}              function tests (MBPP, HumanEval style): the
        program runs once, then each test runs in a trusted harness that decides the result; the
        program's exit status counts for nothing (megarl/sandbox/harness.py says how and what remains). A test
        may expect an exception: `try: f(-1)` ... `except ValueError:` catches what the program raises.

The program is the last ```python fenced block of the response (else the last fenced block, else the
whole response). The score is 1.0 when every test passes, else 0.0; testing stops at the first failure.
A test that runs out of time or memory fails; so does output cut at the sandbox's limit. Only a
malformed reference raises, and one of call-based tests (a `fn_name` with argument lists as inputs, as some APPS and
TACO rows have), which this reward does not run: scoring them as stdin tests would fail every response.
"""

from __future__ import annotations

import json
import re

from megarl.rewards import REWARD_BUILDERS
from megarl.sandbox.harness import run_function_tests
from megarl.sandbox.runner import Sandbox, SandboxLimits

FENCED = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    blocks = FENCED.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [code for _, code in blocks])[-1]
    return response


def same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]
    return lines(actual) == lines(expected)


def code_tests(answer: str | dict) -> dict:
    """The tests of a reference (the module docstring's forms), or ValueError saying what is wrong with it."""
    try:
        tests = json.loads(answer) if isinstance(answer, str) else answer
    except json.JSONDecodeError as e:
        raise ValueError(f"code reference is not JSON ({e}): {answer[:100]!r}") from None
    if not isinstance(tests, dict):
        raise ValueError(f"code reference must be a JSON object, got {type(tests).__name__}")
    if tests.get("fn_name"):
        raise ValueError(f"code reference has call-based tests (fn_name={tests['fn_name']!r}), which the code reward "
                         "does not run: it runs stdin/stdout tests and asserts")
    if "asserts" in tests:
        return tests
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("code reference must have 'asserts', or 'inputs' and 'outputs' lists of equal length")
    return tests


class CodeReward:
    """Callable reward over one sandbox (its `slots` bound how many programs run at once)."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024, slots: int = 4, mode: str = "auto"):
        self.sandbox = Sandbox(SandboxLimits(wall_s=timeout_s, memory_mb=memory_mb), mode=mode, slots=slots)

    def __call__(self, response: str, answer: str | dict, sample: dict) -> float:
        tests = code_tests(answer)
        program = extract_program(response)
        if "asserts" in tests:
            asserts = tests["asserts"]
            return float(run_function_tests(self.sandbox, program, [asserts] if isinstance(asserts, str) else asserts).ok)
        for stdin, expected in zip(tests["inputs"], tests["outputs"]):
            result = self.sandbox.run(program, stdin=stdin)
            if not result.ok or result.output_truncated or not same_output(result.stdout, expected):
                return 0.0
        return 1.0

    def close(self) -> None:
        self.sandbox.close()


@REWARD_BUILDERS.register("code")
def build_code_reward(cfg) -> CodeReward:
    return CodeReward(timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb, slots=max(1, cfg.num_workers),
                      mode=cfg.code_sandbox)
