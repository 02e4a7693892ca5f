import pytest
import torch

from megarl.algorithms import ADVANTAGES, compute_advantages
from megarl.config import AlgorithmConfig
from megarl.protocol import Batch

# Four groups, interleaved on purpose (group membership comes from the ids, not the order):
#   group 0: rewards 1, 0, 0, 1  mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.577350
#   group 1: rewards 2, 4, 6     mean 4,   unbiased std sqrt((4 + 0 + 4) / 2) = 2
#   group 2: reward 3 alone      -> advantage 0
#   group 3: rewards 0.7, 0.7    all equal -> advantage 0 (0 / (0 + eps), no NaN)
GROUP = [0, 1, 0, 2, 1, 0, 1, 0, 3, 3]
REWARDS = [1.0, 2.0, 0.0, 3.0, 4.0, 0.0, 6.0, 1.0, 0.7, 0.7]
# prompt of 1-2 tokens, then a response of 1-3 tokens, then padding (T = 5)
MASK = [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 1, 1, 0],
        [0, 1, 0, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]


def make_batch():
    return Batch({"rewards": torch.tensor(REWARDS), "loss_mask": torch.tensor(MASK, dtype=torch.float32)},
                 {"group": GROUP})


def per_sample(advantages):
    """The one value each row carries on its response tokens (all its masked tokens must share it)."""
    mask = torch.tensor(MASK, dtype=torch.bool)
    assert (advantages[~mask] == 0).all()
    values = []
    for row, m in zip(advantages, mask):
        assert torch.allclose(row[m], row[m][0].expand(int(m.sum())))
        values.append(row[m][0].item())
    return values


def test_grpo_normalised_by_unbiased_group_std():
    adv = ADVANTAGES.get("grpo")(make_batch(), AlgorithmConfig(norm_adv_by_std=True))
    s = 0.5 / (1 / 3) ** 0.5  # 0.866025: group 0's |r - mean| / std
    expected = [s, -1.0, -s, 0.0, 0.0, -s, 1.0, s, 0.0, 0.0]
    assert per_sample(adv) == pytest.approx(expected, abs=1e-5)
    assert torch.isfinite(adv).all()


def test_dr_grpo_only_centres():
    adv = ADVANTAGES.get("grpo")(make_batch(), AlgorithmConfig(norm_adv_by_std=False))
    expected = [0.5, -2.0, -0.5, 0.0, 0.0, -0.5, 2.0, 0.5, 0.0, 0.0]
    assert per_sample(adv) == pytest.approx(expected, abs=1e-6)


def test_rloo_leave_one_out_baseline():
    adv = ADVANTAGES.get("rloo")(make_batch(), AlgorithmConfig())
    # group 0: r=1 -> 1 - mean(0, 0, 1) = 2/3; r=0 -> 0 - mean(1, 0, 1) = -2/3
    # group 1: r=2 -> 2 - mean(4, 6) = -3; r=4 -> 0; r=6 -> 6 - 3 = 3
    expected = [2 / 3, -3.0, -2 / 3, 0.0, 0.0, -2 / 3, 3.0, 2 / 3, 0.0, 0.0]
    assert per_sample(adv) == pytest.approx(expected, abs=1e-6)


def test_all_equal_and_single_sample_groups_give_zero_not_nan():
    batch = Batch({"rewards": torch.tensor([1.0, 1.0, 1.0, 5.0]), "loss_mask": torch.ones(4, 2)},
                  {"group": ["a", "a", "a", "b"]})
    for norm in (True, False):
        adv = ADVANTAGES.get("grpo")(batch, AlgorithmConfig(norm_adv_by_std=norm))
        assert torch.equal(adv, torch.zeros(4, 2))


def test_compute_advantages_stores_result():
    batch = compute_advantages(make_batch(), AlgorithmConfig(advantage="grpo", norm_adv_by_std=False))
    assert per_sample(batch["advantages"])[:2] == pytest.approx([0.5, -2.0])


def test_user_estimator_by_module_path_and_its_output_is_checked(tmp_path, monkeypatch):
    (tmp_path / "my_estimators.py").write_text(
        "def constant(batch, cfg):\n    return 3.0 * batch['loss_mask']\n"
        "def per_sample(batch, cfg):\n    return batch['rewards']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = compute_advantages(make_batch(), AlgorithmConfig(advantage="my_estimators:constant"))
    assert per_sample(batch["advantages"]) == [3.0] * 10
    with pytest.raises(ValueError, match=r"returned shape \(10,\), expected \(10, 5\)"):
        compute_advantages(make_batch(), AlgorithmConfig(advantage="my_estimators:per_sample"))
