import math

import pytest
import torch

from megarl.algorithms import actor_loss, aggregate, kl_penalty, sft_loss
from megarl.algorithms.losses import POLICY_LOSSES
from megarl.config import AlgorithmConfig

LN = math.log

# PPO-clip, eps = 0.2: ratios 1.1 (inside), 1.5 (above 1.2), 0.5 (below 0.8), with A = +2 and A = -1.
#   A=+2: r=1.1 -> max(-2.2, -2.2) = -2.2           not clipped
#         r=1.5 -> max(-3.0, -2*1.2 = -2.4) = -2.4  clipped (gradient cut)
#         r=0.5 -> max(-1.0, -2*0.8 = -1.6) = -1.0  not clipped (pessimistic side keeps the gradient)
#   A=-1: r=1.1 -> max(1.1, 1.1) = 1.1              not clipped
#         r=1.5 -> max(1.5, 1.2) = 1.5              not clipped
#         r=0.5 -> max(0.5, 0.8) = 0.8              clipped
# The 4th column is padding with junk values that must not matter.
OLD = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, -3.0, 0.0]])
RATIOS = torch.tensor([[1.1, 1.5, 0.5, 1.0], [1.1, 1.5, 0.5, 1.0]])
NEW = OLD + RATIOS.log() + torch.tensor([[0, 0, 0, 500.0], [0, 0, 0, -500.0]])
ADV = torch.tensor([[2.0, 2.0, 2.0, 7.0], [-1.0, -1.0, -1.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
PER_TOKEN = [[-2.2, -2.4, -1.0], [1.1, 1.5, 0.8]]


def mb(**extra):
    return {"loss_mask": MASK, "old_logprobs": OLD, "advantages": ADV, **extra}


def test_ppo_clip_per_token_values_and_clipfrac():
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(NEW, mb(), AlgorithmConfig(clip_eps=0.2))
    assert loss[0, :3].tolist() == pytest.approx(PER_TOKEN[0], abs=1e-5)
    assert loss[1, :3].tolist() == pytest.approx(PER_TOKEN[1], abs=1e-5)
    assert metrics["clipfrac"][:, :3].tolist() == [[0, 1, 0], [0, 0, 1]]


def test_ppo_clip_asymmetric_upper_range():
    # clip_eps_high = 0.28 (DAPO's clip-higher): with A = +2, r = 1.25 is now inside (-2.5, not clipped)
    # and r = 1.5 is clipped at 1.28 (-2.56); the lower side stays 0.8 (r = 0.5 -> max(-1.0, -1.6) = -1.0).
    ratios = torch.tensor([[1.25, 1.5, 0.5]])
    cfg = AlgorithmConfig(clip_eps=0.2, clip_eps_high=0.28)
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(ratios.log(), {"old_logprobs": torch.zeros(1, 3),
                                                                 "advantages": torch.full((1, 3), 2.0)}, cfg)
    assert loss[0].tolist() == pytest.approx([-2.5, -2.56, -1.0], abs=1e-5)
    assert metrics["clipfrac"][0].tolist() == [0, 1, 0]


def test_actor_loss_token_mean_metrics_and_gradient():
    logprobs = NEW.clone().requires_grad_()
    loss, metrics = actor_loss(AlgorithmConfig(clip_eps=0.2), logprobs, None, mb(), total_tokens=6, total_seqs=2)
    # pg_loss = (-2.2 - 2.4 - 1.0 + 1.1 + 1.5 + 0.8) / 6 = -2.2 / 6
    assert loss.item() == pytest.approx(-2.2 / 6, abs=1e-5)
    assert metrics["pg_loss"].item() == pytest.approx(-2.2 / 6, abs=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 6)
    # approx_kl = mean(old - new) = -2 * (ln 1.1 + ln 1.5 + ln 0.5) / 6 = 0.064124
    assert metrics["approx_kl"].item() == pytest.approx(-2 * (LN(1.1) + LN(1.5) + LN(0.5)) / 6, abs=1e-5)
    assert metrics["ratio"].item() == pytest.approx(2 * (1.1 + 1.5 + 0.5) / 6, abs=1e-5)
    assert "kl" not in metrics and "entropy" not in metrics
    loss.backward()
    # d(-A * r)/d logprob = -A * r on unclipped tokens; clipped and padding tokens get 0 (and no NaN)
    expected = torch.tensor([[-2 * 1.1, 0.0, -2 * 0.5, 0.0], [1.1, 1.5, 0.0, 0.0]]) / 6
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)


def test_kl_estimators_hand_values():
    x = torch.tensor([0.0, 1.0, -1.0, 2.0])  # logprob - ref_logprob
    ref = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    lp = ref + x
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([0.0, 1.0, -1.0, 2.0])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.0, 0.5, 0.5, 2.0])
    # k3 = exp(-x) + x - 1: 0; e^-1 = 0.367879; e - 2 = 0.718282; e^-2 + 1 = 1.135335
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx([0.0, 0.367879, 0.718282, 1.135335], abs=1e-6)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    # Expectation under the policy p, taken exactly over a 5-token vocabulary: E_p[k1] = E_p[k3] = KL(p || ref)
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    kl = (p * (p / ref).log()).sum().item()
    for estimator in ("k1", "k3"):
        estimate = (p * kl_penalty(p.log(), ref.log(), estimator).double()).sum().item()
        assert estimate == pytest.approx(kl, rel=1e-5)


# Aggregation over 4 sequences split into two micro-batches (rows 0-1 and rows 2-3):
#   row 0: values 1 2 3, mask 1 1 0 -> token sum 3,  2 tokens, token mean 1.5
#   row 1: values 4 5 6, mask 1 1 1 -> token sum 15, 3 tokens, token mean 5
#   row 2: values 7 8 9, mask 1 0 0 -> token sum 7,  1 token,  token mean 7
#   row 3: values 2 2 2, mask 0 0 0 -> no response tokens: contributes 0
# totals: 6 tokens, 4 sequences.
VALUES = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9], [2, 2, 2]])
AGG_MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("mode, first, second", [
    ("token-mean", 18 / 6, 7 / 6),                  # 25 / 6 = 4.1667 (not the mean of 3.6 and 7)
    ("seq-mean-token-sum", 18 / 4, 7 / 4),          # (3 + 15 + 7 + 0) / 4 = 6.25
    ("seq-mean-token-mean", 6.5 / 4, 7 / 4),        # (1.5 + 5 + 7 + 0) / 4 = 3.375
])
def test_aggregation_contributions_sum_to_the_global_mean(mode, first, second):
    parts = [aggregate(VALUES[rows], AGG_MASK[rows], mode, total_tokens=6, total_seqs=4)
             for rows in (slice(0, 2), slice(2, 4))]
    assert [p.item() for p in parts] == pytest.approx([first, second])
    whole = aggregate(VALUES, AGG_MASK, mode, total_tokens=6, total_seqs=4)
    assert whole.item() == pytest.approx(first + second)


def test_aggregation_ignores_non_finite_padding_and_names_unknown_modes():
    values = torch.tensor([[1.0, float("nan"), float("inf")]])
    assert aggregate(values, torch.tensor([[1.0, 0, 0]]), "token-mean", 1, 1).item() == 1.0
    with pytest.raises(KeyError, match="did you mean 'token-mean'"):
        aggregate(values, torch.ones(1, 3), "token_mean", 1, 1)


def test_actor_loss_micro_batches_sum_to_full_batch_with_kl_and_entropy():
    torch.manual_seed(0)
    b, t = 6, 5
    old = -torch.rand(b, t) * 3
    new = old + 0.3 * torch.randn(b, t)
    batch = {"loss_mask": (torch.rand(b, t) > 0.3).float(), "old_logprobs": old,
             "advantages": torch.randn(b, 1).expand(b, t).contiguous(), "ref_logprobs": old + 0.2 * torch.randn(b, t)}
    entropy = torch.rand(b, t)
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    tokens, seqs = batch["loss_mask"].sum().item(), float(b)

    full_lp = new.clone().requires_grad_()
    full_loss, full_metrics = actor_loss(cfg, full_lp, entropy, batch, tokens, seqs)
    full_loss.backward()
    # the loss is exactly its reported terms
    expected = full_metrics["pg_loss"] + 0.1 * full_metrics["kl"] - 0.01 * full_metrics["entropy"]
    assert full_loss.item() == pytest.approx(expected.item(), abs=1e-6)
    # kl and entropy metrics are the masked token means
    mask = batch["loss_mask"]
    k3 = torch.exp(batch["ref_logprobs"] - new) - (batch["ref_logprobs"] - new) - 1
    assert full_metrics["kl"].item() == pytest.approx(((k3 * mask).sum() / tokens).item(), abs=1e-6)
    assert full_metrics["entropy"].item() == pytest.approx(((entropy * mask).sum() / tokens).item(), abs=1e-6)

    micro_lp = new.clone().requires_grad_()
    total, summed = 0.0, {}
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven micro-batches
        loss, metrics = actor_loss(cfg, micro_lp[rows], entropy[rows], {k: v[rows] for k, v in batch.items()},
                                   tokens, seqs)
        loss.backward()
        total += loss.item()
        for k, v in metrics.items():
            summed[k] = summed.get(k, 0.0) + v.item()
    assert total == pytest.approx(full_loss.item(), abs=1e-6)
    assert summed == pytest.approx({k: v.item() for k, v in full_metrics.items()}, abs=1e-6)
    assert torch.allclose(micro_lp.grad, full_lp.grad, atol=1e-7)


def test_actor_loss_requires_what_its_coefficients_need():
    with pytest.raises(ValueError, match="entropy_coef"):
        actor_loss(AlgorithmConfig(entropy_coef=0.01), NEW, None, mb(), 6, 2)
    with pytest.raises(KeyError, match="ref_logprobs"):
        actor_loss(AlgorithmConfig(kl_coef=0.1), NEW, None, mb(), 6, 2)


def test_sft_loss_is_token_mean_nll_contribution():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # (1 + 2 + 3 + 0.5) / 4 = 1.625; as half of an 8-token mini-batch: 6.5 / 8
    assert sft_loss(logprobs, mask, 4).item() == pytest.approx(1.625)
    assert sft_loss(logprobs, mask, 8).item() == pytest.approx(6.5 / 8)
