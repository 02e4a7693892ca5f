import time

import pytest

from megarl.rewards import get_reward_fn, score
from megarl.rewards import math as math_module
from megarl.rewards.math import math_equal
from megarl.rewards.scoring import RewardTimeout

math_reward = get_reward_fn("math")


@pytest.mark.parametrize("response, answer, expected", [
    ("So $x = \\frac{1}{2}$, i.e. \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{\\dfrac12}.", "\\frac{1}{2}", 1.0),          # \dfrac, no braces
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", 1.0),                          # equal after simplification
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{90}", "90^\\circ", 1.0),
    ("\\boxed{[1, 3)}", "[1,3)", 1.0),
    ("\\boxed{1/3}", "\\frac{1}{2}", 0.0),
    ("Some say 10. " * 300 + "But the answer is \\boxed{12}", "10", 0.0),  # the boxed answer wins
    ("I could not solve it.", "5", 0.0),                               # no answer at all
])
def test_math_verify_answers(response, answer, expected):
    assert math_reward(response, answer, {}) == expected


def test_a_check_that_never_ends_is_killed_and_the_next_one_works():
    # 9^(9^(9^9)) has ~10^8 digits: sympy computes it inside one C call that no signal interrupts
    start = time.monotonic()
    with pytest.raises(RewardTimeout):
        math_equal("\\boxed{9^{9^{9^{9}}}}", "2", timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert math_equal("\\boxed{2}", "2") is True  # a fresh checking process


def test_score_counts_a_timed_out_math_check_as_failed(monkeypatch):
    monkeypatch.setattr(math_module, "MATH_TIMEOUT_S", 1.0)
    samples = [{"response": "\\boxed{9^{9^{9^{9}}}}", "answer": "2"}, {"response": "\\boxed{2}", "answer": "2"}]
    # the first check is killed at its own limit; the second waits for a fresh process, off its clock
    scores = score(samples, math_reward, timeout_s=30.0)
    assert (scores.rewards, scores.failed) == ([0.0, 1.0], 1)
