import pytest
import torch

from megarl.data.evaluation import eval_metrics


def test_pass_and_mean_at_k():
    # 3 prompts x 4 samples: prompt a solved 2/4, b 0/4 (partial credit 0.5 once), c 4/4
    rewards = torch.tensor([1, 0, 1, 0, 0, 0, 0.5, 0, 1, 1, 1, 1.0])
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    m = eval_metrics(rewards, groups)
    assert m["val/pass@4"] == pytest.approx(2 / 3)                        # a and c have a correct sample
    assert m["val/mean@4"] == pytest.approx((0.5 + 0.125 + 1.0) / 3)
    assert m["val/reward"] == pytest.approx(6.5 / 12)
    assert m["val/accuracy"] == pytest.approx(6 / 12)
    assert eval_metrics(rewards, groups, correct_at=0.5)["val/pass@4"] == 1.0


def test_k_equal_one_and_unequal_groups():
    m = eval_metrics(torch.tensor([1.0, 0.0, 1.0]), [0, 1, 2], prefix="test")
    assert m == {"test/reward": pytest.approx(2 / 3), "test/accuracy": pytest.approx(2 / 3),
                 "test/mean@1": pytest.approx(2 / 3), "test/pass@1": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="same number of samples"):
        eval_metrics(torch.tensor([1.0, 0.0, 1.0]), [0, 0, 1])
