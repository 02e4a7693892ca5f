
import numpy as np
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
    scores = score(batch, fn)
    assert scores.rewards == [1.0, 0.0, 0.0, 4.0] and scores.failed == 2
    assert [f.index for f in scores.failures] == [1, 2]
    assert score([{"prompt": "ab", "response": "r", "answer": "a"}], fn).rewards == [2.0]


RETURNED = {"str": "0.75", "none": None, "list": [1.0], "object": object(), "inf": float("inf"),
            "1d_tensor": torch.tensor([0.5]), "np_nan": np.float64("nan"),
            "int": 2, "float": 0.25, "bool": True, "np_float32": np.float32(0.5), "np_int64": np.int64(3),
            "np_bool": np.bool_(True), "np_0d": np.array(1.5), "torch": torch.tensor(0.75),
            "torch_int": torch.tensor(4)}


def return_as_named(response, answer, sample):
    return RETURNED[response]


def test_a_reward_must_be_a_finite_number():
    names = list(RETURNED)
    scores = score([{"response": name, "answer": ""} for name in names], return_as_named)
    assert dict(zip(names, scores.rewards)) == {
        "str": 0.0, "none": 0.0, "list": 0.0, "object": 0.0, "inf": 0.0, "1d_tensor": 0.0, "np_nan": 0.0,
        "int": 2.0, "float": 0.25, "bool": 1.0, "np_float32": 0.5, "np_int64": 3.0, "np_bool": 1.0, "np_0d": 1.5,
        "torch": 0.75, "torch_int": 4.0}
    assert [names[f.index] for f in scores.failures] == ["str", "none", "list", "object", "inf", "1d_tensor", "np_nan"]
    assert "reward returned str '0.75'; expected a number" in str(scores.failures[0].error)
    assert all(type(r) is float for r in scores.rewards)
