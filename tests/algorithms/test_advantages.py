import pytest
import torch

from megarl.algorithms import ADVANTAGES, compute_advantages
from megarl.algorithms.advantages import discounted_returns, gae, masked_whiten, token_level_rewards
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


def per_sample(advantages, mask=None):
    """The one value each row carries on its response tokens (all its masked tokens must share it); `mask`
    (a loss_mask) defaults to MASK."""
    mask = torch.tensor(MASK, dtype=torch.bool) if mask is None else mask > 0
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


# ---------------------------------------------------------------------------------------------
# Token-level building blocks and estimators

# Three rows of T = 5: a plain response (prompt, 3 response tokens, padding), a multi-turn response whose
# 3rd position is a tool output (not trained: skipped), and an empty response. 9.0 marks values at
# untrained positions that must not matter.
GAE_MASK = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
GAE_VALUES = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0], [0.2, 0.4, 9.0, 0.1, 9.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
GAE_REWARDS = torch.tensor([[0.0, 0.0, 0.0, 1.0, 9.0], [0.0, 0.0, 9.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 9.0]])
# gamma = 0.9, lam = 0.8 (gamma * lam = 0.72):
#   row 0  t=3: delta = 1 + 0 - 0.7 = 0.3                 A = 0.3
#          t=2: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03        A = 0.03 + 0.72 * 0.3   = 0.246
#          t=1: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04        A = 0.04 + 0.72 * 0.246 = 0.21712
#   row 1  t=3: delta = 2 - 0.1 = 1.9                     A = 1.9
#          t=2: tool output, skipped                       A = 0
#          t=1: delta = 0 + 0.9 * 0.1 - 0.4 = -0.31       A = -0.31 + 0.72 * 1.9  = 1.058
#          t=0: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16        A = 0.16 + 0.72 * 1.058 = 0.92176
GAE_ADV = [[0.0, 0.21712, 0.246, 0.3, 0.0], [0.92176, 1.058, 0.0, 1.9, 0.0], [0.0] * 5]
GAE_RETURNS = [[0.0, 0.71712, 0.846, 1.0, 0.0], [1.12176, 1.458, 0.0, 2.0, 0.0], [0.0] * 5]  # A + V


def test_gae_hand_values_skip_untrained_positions():
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.8)
    assert adv.tolist() == [pytest.approx(row, abs=1e-6) for row in GAE_ADV]
    assert ret.tolist() == [pytest.approx(row, abs=1e-6) for row in GAE_RETURNS]


def test_gae_limits_monte_carlo_and_one_step_td():
    # lam = gamma = 1: A_t = (sum of later rewards) - V_t: row 0: 1 - 0.5, 1 - 0.6, 1 - 0.7; row 1: 2 - 0.2 ...
    adv, _ = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=1.0)
    assert adv[:2].tolist() == [pytest.approx([0, 0.5, 0.4, 0.3, 0]), pytest.approx([1.8, 1.6, 0, 1.9, 0])]
    # lam = 0: A_t = delta_t (one-step TD), the deltas above
    adv, _ = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.0)
    assert adv[:2].tolist() == [pytest.approx([0, 0.04, 0.03, 0.3, 0]), pytest.approx([0.16, -0.31, 0, 1.9, 0])]


def test_gae_estimator_places_the_reward_whitens_and_stores_returns():
    batch = Batch({"rewards": torch.tensor([1.0, 2.0, 5.0]), "loss_mask": GAE_MASK, "values": GAE_VALUES},
                  {"group": [0, 1, 2]})
    batch = compute_advantages(batch, AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.8))
    # the sequence rewards land on the last trained tokens (row 0 t=3, row 1 t=3; row 2 has none), so the
    # raw advantages are GAE_ADV; whitened over the 6 trained tokens: mean 4.64288 / 6 = 0.773813
    raw = [0.21712, 0.246, 0.3, 0.92176, 1.058, 1.9]
    mean, std = sum(raw) / 6, (sum((a - sum(raw) / 6) ** 2 for a in raw) / 5) ** 0.5  # unbiased std 0.660899
    assert mean == pytest.approx(0.773813, abs=1e-6) and std == pytest.approx(0.660899, abs=1e-6)
    mask = GAE_MASK.bool()
    assert batch["advantages"][mask].tolist() == pytest.approx([(a - mean) / std for a in raw], abs=1e-5)
    assert (batch["advantages"][~mask] == 0).all()
    assert batch["returns"].tolist() == [pytest.approx(row, abs=1e-6) for row in GAE_RETURNS]
    with pytest.raises(KeyError, match="needs batch\\['values'\\]"):
        compute_advantages(make_batch(), AlgorithmConfig(advantage="gae"))


def kl_batch():
    # row 0: response at t=1,2; row 1: empty; row 2: a hole at t=1. old - ref log-probs per token (k1), 9 = junk
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    ref = torch.full((3, 4), -1.0)
    diff = torch.tensor([[9.0, 0.2, -0.4, 9.0], [9.0] * 4, [0.1, 9.0, 0.3, 0.6]])
    return Batch({"rewards": torch.tensor([1.0, 3.0, -1.0]), "loss_mask": mask, "old_logprobs": ref + diff,
                  "ref_logprobs": ref}, {"group": [0, 1, 2]})


def test_token_level_rewards_with_and_without_kl_in_reward():
    batch = kl_batch()
    plain = token_level_rewards(batch, AlgorithmConfig(kl_coef=0.5, kl_in_reward=False))
    assert plain.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, -1]]
    assert "reward_kl" not in batch.meta
    # kl_coef 0.5, k1: row 0: -0.5 * 0.2 = -0.1, 1 - 0.5 * (-0.4) = 1.2; row 2: -0.05, -0.15, -1 - 0.3 = -1.3
    shaped = token_level_rewards(batch, AlgorithmConfig(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1"))
    assert shaped.tolist() == [pytest.approx([0, -0.1, 1.2, 0]), [0, 0, 0, 0], pytest.approx([-0.05, 0, -0.15, -1.3])]
    # mean KL per trained token: (0.2 - 0.4 + 0.1 + 0.3 + 0.6) / 5 = 0.16
    assert batch.meta["reward_kl"] == pytest.approx(0.16)


def test_discounted_returns_and_masked_whiten():
    # gamma 0.5, rewards on the last token; row 2 has a hole at t=1
    rewards = torch.tensor([[0.0, 0, 0, 4], [0, 0, 2, 0], [1, 7, 0, 8]])
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0], [1, 0, 1, 1]])
    # row 0: 1, 2, 4; row 1: 1, 2; row 2: t=3: 8, t=2: 0 + 4 = 4, t=0: 1 + 0.5 * 4 = 3
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0, 1, 2, 4], [0, 1, 2, 0], [3, 0, 4, 8]]
    # whiten [1, 2, 3] over a mask: mean 2, unbiased var 1 -> -1, 0, 1; a single or no valid value gives 0
    values = torch.tensor([[1.0, 2.0, 99.0, 3.0]])
    assert masked_whiten(values, torch.tensor([[1.0, 1, 0, 1]]))[0].tolist() == pytest.approx([-1, 0, 0, 1], abs=1e-6)
    assert masked_whiten(values, torch.tensor([[0.0, 1, 0, 0]])).tolist() == [[0, 0, 0, 0]]
    assert masked_whiten(values, torch.zeros(1, 4)).tolist() == [[0, 0, 0, 0]]


def test_reinforce_plus_plus_discounted_then_whitened_over_the_batch():
    batch = Batch({"rewards": torch.tensor([1.0, -1.0, 5.0]),
                   "loss_mask": torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])}, {"group": [0, 0, 1]})
    adv = ADVANTAGES.get("reinforce_plus_plus")(batch, AlgorithmConfig(gamma=0.5))
    # returns, gamma 0.5: row 0: 0.25, 0.5, 1; row 1: -0.5, -1; row 2 empty. Over those 5 tokens: mean 0.05,
    # deviations 0.2, 0.45, 0.95, -0.55, -1.05, squares sum 2.55, unbiased var 2.55 / 4 = 0.6375
    std = 0.6375**0.5
    assert adv.tolist() == [pytest.approx([0, 0.2 / std, 0.45 / std, 0.95 / std], abs=1e-5),
                            pytest.approx([0, -0.55 / std, -1.05 / std, 0], abs=1e-5), [0, 0, 0, 0]]


def test_reinforce_plus_plus_with_kl_in_reward_reports_the_kl():
    batch = compute_advantages(kl_batch(), AlgorithmConfig(advantage="reinforce_plus_plus", kl_coef=0.5,
                                                           kl_in_reward=True, kl_estimator="k1"))
    assert batch.meta["reward_kl"] == pytest.approx(0.16)
    # gamma 1, rewards (above) row 0: -0.1, 1.2 -> returns 1.1, 1.2; row 2: -0.05, -0.15, -1.3 -> -1.5, -1.45, -1.3
    raw = [1.1, 1.2, -1.5, -1.45, -1.3]
    mean = sum(raw) / 5  # -0.39
    std = (sum((r - mean) ** 2 for r in raw) / 4) ** 0.5
    mask = kl_batch()["loss_mask"].bool()
    assert batch["advantages"][mask].tolist() == pytest.approx([(r - mean) / std for r in raw], abs=1e-5)


def test_kl_in_reward_needs_a_token_level_estimator():
    batch = kl_batch()
    with pytest.raises(ValueError, match="estimator 'grpo' does not use token-level rewards"):
        compute_advantages(batch, AlgorithmConfig(advantage="grpo", kl_coef=0.1, kl_in_reward=True))


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whitening():
    batch = Batch({"rewards": torch.tensor([1.0, 0.0, 1.0, 0.5]),
                   "loss_mask": torch.tensor([[1.0, 1, 0], [0, 1, 0], [1, 0, 0], [1, 1, 1]])},
                  {"group": ["a", "a", "a", "b"]})
    adv = ADVANTAGES.get("reinforce_plus_plus_baseline")(batch, AlgorithmConfig(gamma=1.0))
    # group a: mean 2/3 -> 1/3, -2/3, 1/3; b alone -> 0. Tokens: 1/3, 1/3 | -2/3 | 1/3 | 0, 0, 0 (7 tokens)
    # mean 1/21; deviations 2/7 (x3), -5/7, -1/21 (x3); squares 12/49 + 25/49 + 3/441 = 16/21; var 8/63
    std = (8 / 63) ** 0.5
    hi, lo, zero = (2 / 7) / std, (-5 / 7) / std, (-1 / 21) / std
    assert adv.tolist() == [pytest.approx([hi, hi, 0], abs=1e-5), pytest.approx([0, lo, 0], abs=1e-5),
                            pytest.approx([hi, 0, 0], abs=1e-5), pytest.approx([zero] * 3, abs=1e-5)]


def test_reinforce_plus_plus_baseline_all_equal_groups_give_zero():
    batch = Batch({"rewards": torch.tensor([1.0, 1.0, 4.0]), "loss_mask": torch.ones(3, 2)}, {"group": [0, 0, 1]})
    assert torch.equal(ADVANTAGES.get("reinforce_plus_plus_baseline")(batch, AlgorithmConfig()), torch.zeros(3, 2))


def test_remax_subtracts_the_greedy_reward():
    batch = Batch({"rewards": torch.tensor([1.0, 0.0, 0.5, 2.0]),
                   "baseline_rewards": torch.tensor([0.5, 0.5, 0.5, 1.0]),
                   "loss_mask": torch.tensor([[0.0, 1, 1], [1, 1, 0], [0, 0, 1], [0, 0, 0]])}, {"group": [0, 0, 1, 1]})
    adv = compute_advantages(batch, AlgorithmConfig(advantage="remax"))["advantages"]
    # 1 - 0.5 = 0.5, 0 - 0.5 = -0.5, 0.5 - 0.5 = 0, and the empty row 3 stays 0
    assert adv.tolist() == [[0, 0.5, 0.5], [-0.5, -0.5, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(KeyError, match="baseline_rewards"):
        ADVANTAGES.get("remax")(make_batch(), AlgorithmConfig())


def test_empty_responses_get_zero_advantages_from_every_estimator():
    mask = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    batch = Batch({"rewards": torch.tensor([1.0, 2.0, 0.0, 7.0]), "loss_mask": mask, "values": torch.ones(4, 2),
                   "baseline_rewards": torch.zeros(4)}, {"group": [0, 0, 0, 0]})
    for name in ("grpo", "rloo", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"):
        adv = compute_advantages(batch, AlgorithmConfig(advantage=name))["advantages"]
        assert adv[1].tolist() == [0, 0] and adv[3].tolist() == [0, 0], name
        assert adv[0, 1] != 0, name
