"""Code with test cases: the response's program runs in the sandbox (megarl/sandbox/).

The reference answer is JSON in one of two forms:

  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}   stdin/stdout tests (APPS, CodeContests style):
        the program runs once per case with the input on stdin; its stdout must equal the output,
        compared line by line with trailing whitespace and trailing blank lines ignored.
  {"asserts": ["assert add(1, 2) == 3", ...]}              function tests (MBPP, HumanEval style): the
        program runs once, then each test runs in a trusted harness that decides the result; the
        program's exit status counts for nothing (megarl/sandbox/harness.py says how and what remains).

The program is the last ```python fenced block of the response (else the last fenced block, else the
whole response). The score is 1.0 when every test passes, else 0.0; testing stops at the first failure.
A test that runs out of time or memory fails; so does output cut at the sandbox's limit. Only a
malformed reference raises.
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


class CodeReward:
    """Callable reward over one sandbox (its `slots` bound how many programs run at once)."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024, slots: int = 4, mode: str = "auto"):
        self.sandbox = Sandbox(SandboxLimits(wall_s=timeout_s, memory_mb=memory_mb), mode=mode, slots=slots)

    def __call__(self, response: str, answer: str, sample: dict) -> float:
        tests = json.loads(answer)
        program = extract_program(response)
        if "asserts" in tests:
            asserts = tests["asserts"]
            return float(run_function_tests(self.sandbox, program, [asserts] if isinstance(asserts, str) else asserts).ok)
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("code reference must have 'asserts', or 'inputs' and 'outputs' lists of equal length")
        for stdin, expected in zip(inputs, outputs):
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
