import json

import pytest

from megarl.rewards import get_reward_fn

countdown = get_reward_fn("countdown")
PROBLEM = json.dumps({"target": 24, "numbers": [4, 7, 8, 8]})


@pytest.mark.parametrize("response, expected", [
    ("<think>8-4=4, 4*7=28, 28-8=20... no</think><answer>(8 - 4) * 7 - 8 + 4</answer>", 0.1),  # 4 used twice
    ("<answer>(7 - 8 / 8) * 4</answer>", 1.0),                  # (7 - 1) * 4 = 24, exact division
    ("<answer>8 * 8 / 4 + 7 = 23</answer>", 0.1),               # right numbers, wrong value (23)
    ("<answer>(7 - 8 / 8) * 4</answer> then <answer>7*4</answer>", 0.1),  # the last tag counts
    ("<answer>(8 + 8) * 7 / 4</answer>", 0.1),                   # 28: exact rationals, no rounding to 24
    ("<answer>8 / (8 - 8) + 4 * 7</answer>", 0.1),              # division by zero: format credit only
    ("<answer>__import__('os')</answer>", 0.0),                  # not arithmetic: never evaluated
    ("<answer>7 ** 8 ** 8 - 4</answer>", 0.0),                   # powers are refused before any computation
    ("<answer>(7 - 8 / 8 * 4</answer>", 0.0),                    # unbalanced parenthesis
    ("(7 - 8 / 8) * 4", 0.0),                                   # no tag
])
def test_countdown(response, expected):
    assert countdown(response, PROBLEM, {}) == expected
