import pytest

from megarl.rewards import get_reward_fn

strict, flexible = get_reward_fn("gsm8k"), get_reward_fn("gsm8k_flexible")
LONG = "Natalia sold 48/2 = 24 clips in May.\n" * 200  # a long chain of reasoning full of other numbers


@pytest.mark.parametrize("response, answer, strict_score, flexible_score", [
    ("48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("#### 72.00", "72", 1.0, 1.0),                       # same decimal value
    ("#### $1,234", "1234", 1.0, 1.0),                    # currency and thousands separators
    ("#### -5", "-5", 1.0, 1.0),
    ("So the answer is 72.", "72", 0.0, 1.0),             # no marker: only the flexible reader finds it
    ("#### 70\nwait, recount: 72", "72", 0.0, 1.0),       # strict takes the marked number, flexible the last
    ("#### 71\n#### 72", "72", 1.0, 1.0),                 # the last marker counts
    ("#### 73", "72", 0.0, 0.0),
    ("#### 1e999", "1", 1.0, 0.0),                        # no exponents: reads "1"; flexible's last number is 999
    ("#### 1e999", "72", 0.0, 0.0),
    ("####", "72", 0.0, 0.0),                             # malformed: marker with no number
    ("", "72", 0.0, 0.0),
    ("#### 7" + "2" * 5000, "72", 0.0, 0.0),              # a 5001-digit number is compared exactly, not overflowed
    (LONG + "In total 48 + 24 = 72.\n#### 72", "72", 1.0, 1.0),
    (LONG, "72", 0.0, 0.0),
])
def test_gsm8k_strict_and_flexible(response, answer, strict_score, flexible_score):
    assert strict(response, answer, {}) == strict_score
    assert flexible(response, answer, {}) == flexible_score


def test_reference_that_is_not_a_number_is_an_error():
    with pytest.raises(ValueError, match="not a number"):
        strict("#### 3", "three", {})
