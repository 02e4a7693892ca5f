
import pytest
import torch

from megarl.protocol import Batch
from megarl.rewards import get_reward_fn, score


@pytest.mark.parametrize("response, expected", [
    ("dcba", 1.0), ("dcbx", 0.75), ("xcbx", 0.5), ("dcb", 0.75), ("dcbaa", 0.8), ("abcd", 0.0), ("", 0.0)])
def test_reverse_partial_credit(response, expected):
    assert get_reward_fn("reverse")(response, "dcba", {}) == pytest.approx(expected)


@pytest.mark.parametrize("response, expected", [
    ("357", 1.0), (" 357 ", 1.0), ("358", 1 / 3), ("35", 1 / 3), ("3570", 0.375), ("753", 1 / 6), ("abc", 0.0),
    ("", 0.0)])
def test_add_exact_or_partial_digits(response, expected):
    assert get_reward_fn("add")(response, "357", {}) == pytest.approx(expected)


def test_exact_match_and_module_path():
    assert get_reward_fn("exact_match")(" ok", "ok", {}) == 1.0
    assert get_reward_fn("exact_match")("ok!", "ok", {}) == 0.0
    assert get_reward_fn("megarl.rewards.synthetic:reverse_reward") is get_reward_fn("reverse")
    with pytest.raises(KeyError, match="did you mean 'reverse'"):
        get_reward_fn("revers")


def plugin_reward(response, answer, sample):
    if response == "boom":
        raise RuntimeError("reward bug")
    if response == "nan":
        return float("nan")
    return len(sample["prompt"])


def test_score_counts_failures_and_keeps_going():
    batch = Batch({"tokens": torch.zeros(4, 2)},
                  {"prompt": ["a", "bb", "ccc", "dddd"], "response": ["x", "boom", "nan", "y"],
                   "answer": ["", "", "", ""]})
    fn = get_reward_fn(f"{__name__}:plugin_reward")
    rewards, failed = score(batch, fn)
    assert rewards == [1.0, 0.0, 0.0, 4.0] and failed == 2
    assert score([{"prompt": "ab", "response": "r", "answer": "a"}], fn) == ([2.0], 0)
