"""The group estimators (gpg, opo, grpo_passk, optimal_token_baseline) and VAPO's GAE (decoupled,
length-adaptive), against values worked out by hand from each paper's formula."""

import pytest
import torch

from megarl.algorithms import ADVANTAGES, compute_advantages
from megarl.algorithms.advantages import gae, length_adaptive_lambda
from megarl.config import AlgorithmConfig
from megarl.config.knob_sections import GAEConfig, GPGConfig, OTBConfig, PositiveLMConfig
from megarl.protocol import Batch
from tests.algorithms.test_advantages import per_sample


def advantages(name, batch, **cfg):
    """Estimator `name`'s one value per row (tests.algorithms.test_advantages.per_sample)."""
    return per_sample(ADVANTAGES.get(name)(batch, AlgorithmConfig(**cfg)), batch["loss_mask"])


def outcome_batch(rewards, group, lengths):
    """One row per sample: a 1-token prompt, then `length` response tokens, padded to the longest."""
    width = 1 + max(lengths)
    mask = torch.tensor([[0.0] + [1.0] * n + [0.0] * (width - 1 - n) for n in lengths])
    return Batch({"rewards": torch.tensor(rewards), "loss_mask": mask}, {"group": group})


def test_gpg_rescales_by_the_share_of_informative_samples():
    # group 0: rewards 1, 0, 0, 1 (mean 0.5); group 1: 2, 2 (all equal: M = 2); group 2: 5 alone.
    # B = 7 samples, 4 with a non-zero advantage -> alpha = 7 / 4; A = alpha * (r - mean) = +-0.875, F_norm = 1;
    # with F_norm = std (unbiased, sqrt(1/3)): +-0.5 / sqrt(1/3) * 7 / 4
    batch = outcome_batch([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0], [0, 0, 0, 0, 1, 1, 2], [1, 2, 1, 3, 1, 1, 2])
    assert advantages("gpg", batch) == pytest.approx([0.875, -0.875, -0.875, 0.875, 0, 0, 0])
    s = 0.5 / (1 / 3) ** 0.5 * 7 / 4
    assert advantages("gpg", batch, gpg=GPGConfig(norm_by_std=True)) == pytest.approx([s, -s, -s, s, 0, 0, 0], abs=1e-5)


def test_opo_length_weighted_baseline():
    # group 0: rewards 1, 0, 1 with 1, 2, 3 response tokens: b = (1 * 1 + 2 * 0 + 3 * 1) / 6 = 2/3;
    # group 1: one sample is its own baseline -> 0
    batch = outcome_batch([1.0, 0.0, 1.0, 3.0], [0, 0, 0, 1], [1, 2, 3, 2])
    assert advantages("opo", batch) == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.0], abs=1e-6)


def test_grpo_passk_only_the_best_learns():
    # group 0: 0.2, 0.9, 0.5, 0.9: the best ties the second best -> all 0;
    # group 1: 1, 0, 0.5: the best (row 4) leads the second by 0.5; unbiased std of the group 0.5 -> 1
    batch = outcome_batch([0.2, 0.9, 0.5, 0.9, 1.0, 0.0, 0.5], [0, 0, 0, 0, 1, 1, 1], [1] * 7)
    assert advantages("grpo_passk", batch, norm_adv_by_std=False) == pytest.approx([0, 0, 0, 0, 0.5, 0, 0])
    assert advantages("grpo_passk", batch) == pytest.approx([0, 0, 0, 0, 0.5 / (0.5 + 1e-6), 0, 0])
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        ADVANTAGES.get("grpo_passk")(outcome_batch([1.0], [0], [1]), AlgorithmConfig())


@pytest.mark.parametrize("zero_tail, last", [(True, 1.0), (False, 0.0)])
def test_optimal_token_baseline_by_hand(zero_tail, last):
    # one group of two responses after a 1-token prompt: A (reward 1) has 3 tokens, B (reward 0) 2.
    # returns G: A 1, 1, 1; B 0, 0. p (sampled token) A: .5 .5 .5, B: .25 .5; sum p^2 = 0.5 everywhere:
    # w = 1 - 2p + 0.5: A .5 .5 .5, B 1 .5 -> W (cumulative) A .5 1 1.5, B 1 1.5.
    # baseline: col 1 (1 * .5 + 0 * 1) / 1.5 = 1/3, col 2 (1 * 1 + 0) / 2.5 = 0.4, col 3 only A: 1 (its own
    # return; zero tail: A is the only response past col 2 -> baseline 0).
    batch = Batch({"rewards": torch.tensor([1.0, 0.0]),
                   "loss_mask": torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]]),
                   "old_logprobs": torch.tensor([[0.0, 0.5, 0.5, 0.5], [0.0, 0.25, 0.5, 0.0]]).log(),
                   "sum_pi_squared": torch.full((2, 4), 0.5)}, {"group": [7, 7]})
    cfg = AlgorithmConfig(advantage="optimal_token_baseline", otb=OTBConfig(zero_tail=zero_tail))
    adv = compute_advantages(batch, cfg)["advantages"]
    assert adv.tolist() == [pytest.approx([0, 2 / 3, 0.6, last], abs=1e-6),
                            pytest.approx([0, -1 / 3, -0.4, 0], abs=1e-6)]
    del batch.tensors["sum_pi_squared"]
    with pytest.raises(KeyError, match="needs batch\\['sum_pi_squared'\\]"):
        ADVANTAGES.get("optimal_token_baseline")(batch, cfg)


def test_length_adaptive_lambda():
    # 1 - 1 / (alpha * l) with alpha 0.5: l = 2 -> 0, 4 -> 0.5, 10 -> 0.8, 40 -> 0.95; l = 1 -> -1, clamped to 0
    mask = torch.zeros(5, 41)
    for row, n in enumerate([2, 4, 10, 40, 1]):
        mask[row, 1:1 + n] = 1
    assert length_adaptive_lambda(mask, 0.5).tolist() == pytest.approx([0, 0.5, 0.8, 0.95, 0])


def test_decoupled_and_length_adaptive_gae():
    # gamma 1, alpha 1 -> lambda 1 - 1/l: row 0 (2 tokens, reward 1) 0.5, row 1 (4 tokens, reward 0) 0.75.
    # row 0, V = .5 .25: delta 0.25 - 0.5 = -0.25 and 1 - 0.25 = 0.75 -> A = -0.25 + 0.5 * 0.75 = 0.125, 0.75
    # row 1, V = .5 everywhere: deltas 0, 0, 0, -0.5 -> A = -0.5 * 0.75^k from the end:
    #   -0.2109375, -0.28125, -0.375, -0.5
    # critic lambda 1: Monte-Carlo returns, 1 1 for row 0 and 0 0 0 0 for row 1.
    mask = torch.tensor([[0.0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    values = torch.tensor([[0.0, 0.5, 0.25, 0, 0], [0, 0.5, 0.5, 0.5, 0.5]])
    raw = [0.125, 0.75, -0.2109375, -0.28125, -0.375, -0.5]
    advantages, _ = gae(torch.tensor([[0.0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]), values, mask, 1.0,
                        torch.tensor([0.5, 0.75]))
    assert advantages[mask > 0].tolist() == pytest.approx(raw)
    batch = Batch({"rewards": torch.tensor([1.0, 0.0]), "loss_mask": mask, "values": values}, {"group": [0, 1]})
    cfg = AlgorithmConfig(advantage="gae", gamma=1.0, lam=0.95, gae=GAEConfig(critic_lam=1.0, lam_length_alpha=1.0))
    out = compute_advantages(batch, cfg)
    assert out["returns"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    # the advantages are the raw ones whitened over the 6 tokens: (x - mean) / sqrt(unbiased var + 1e-8)
    mean = sum(raw) / 6
    std = (sum((x - mean) ** 2 for x in raw) / 5 + 1e-8) ** 0.5
    assert out["advantages"][mask > 0].tolist() == pytest.approx([(x - mean) / std for x in raw], abs=1e-5)


def test_positive_lm_mask_marks_the_correct_samples():
    batch = outcome_batch([1.0, 0.4, 1.0], [0, 0, 0], [1, 2, 1])
    out = compute_advantages(batch, AlgorithmConfig(positive_lm=PositiveLMConfig(coef=0.1, threshold=1.0)))
    assert out["lm_mask"].tolist() == [[0, 1, 0], [0, 0, 0], [0, 1, 0]]
    assert "lm_mask" not in compute_advantages(outcome_batch([1.0], [0], [1]), AlgorithmConfig())
