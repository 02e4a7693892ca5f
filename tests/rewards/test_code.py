import json

import pytest

from megarl.config import RewardConfig
from megarl.rewards import build_reward, score
from megarl.rewards.code import extract_program

ECHO_SUM = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]})
ADD_ASSERTS = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]})


@pytest.fixture(scope="module")
def code_reward():
    reward = build_reward(RewardConfig(name="code", code_timeout_s=2.0, code_memory_mb=256, num_workers=2))
    yield reward
    reward.close()


def test_program_is_the_last_python_block():
    response = "First try:\n```python\nprint(1)\n```\nBetter:\n```python\nprint(2)\n```\nDone."
    assert extract_program(response) == "print(2)\n"
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    assert extract_program("print(3)") == "print(3)"


@pytest.mark.parametrize("response, answer, expected", [
    ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", ECHO_SUM, 1.0),
    ("```python\na, b = map(int, input().split())\nprint(a * b)\n```", ECHO_SUM, 0.0),   # wrong on both cases
    ("```python\nprint(3)\n```", ECHO_SUM, 0.0),                                          # right on the first only
    ("```python\nwhile True:\n    pass\n```", ECHO_SUM, 0.0),                             # killed at the time limit
    ("```python\ndef add(a, b):\n    return a + b\n```", ADD_ASSERTS, 1.0),
    ("```python\ndef add(a, b):\n    return a - b\n```", ADD_ASSERTS, 0.0),
    ("```python\nimport socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n```",
     json.dumps({"asserts": []}), 0.0),                                                    # no network in the sandbox
])
def test_code_reward_runs_tests_in_the_sandbox(code_reward, response, answer, expected):
    assert code_reward(response, answer, {}) == expected


def test_malformed_reference_is_a_counted_failure(code_reward):
    samples = [{"response": "print(1)", "answer": json.dumps({"inputs": ["1"]})},
               {"response": "```python\ndef add(a, b): return a + b\n```", "answer": ADD_ASSERTS}]
    scores = score(samples, code_reward, timeout_s=10, num_workers=2)
    assert (scores.rewards, scores.failed) == ([0.0, 1.0], 1)
