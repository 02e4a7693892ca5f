"""The policy losses of megarl/algorithms/loss_variants.py against values worked out by hand from each paper's
formula (old log-probs 0 unless said, so a token's log-prob is its log-ratio)."""

import math

import pytest
import torch

from megarl.algorithms import actor_loss
from megarl.algorithms.losses import POLICY_LOSSES
from megarl.config import AlgorithmConfig
from megarl.config.knob_sections import CISPOConfig, ClipCovConfig, GMPOConfig, KLCovConfig, SAPOConfig

LN = math.log


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def run(name, logprobs, advantages, cfg=None, old=None, mask=None):
    """(per-token loss, metrics, d sum(loss) / d logprobs) of policy loss `name`."""
    logprobs = torch.tensor(logprobs).requires_grad_()
    advantages = torch.tensor(advantages)
    mb = {"loss_mask": torch.ones_like(advantages) if mask is None else torch.tensor(mask),
          "old_logprobs": torch.zeros_like(advantages) if old is None else torch.tensor(old),
          "advantages": advantages}
    loss, metrics = POLICY_LOSSES.get(name)(logprobs, mb, cfg or AlgorithmConfig(policy_loss=name))
    loss.sum().backward()
    return loss.detach(), metrics, logprobs.grad


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
def test_gpg_is_the_plain_policy_gradient(name):
    # -A * log p: log p -0.5, -2 with A = 2, -1 -> 1.0, -2.0; gradient -A = -2, 1
    loss, metrics, grad = run(name, [[-0.5, -2.0]], [[2.0, -1.0]], old=[[-0.5, -1.0]])
    assert loss.tolist() == [pytest.approx([1.0, -2.0])]
    assert grad.tolist() == [pytest.approx([-2.0, 1.0])]
    assert metrics["ratio"].tolist() == [pytest.approx([1.0, math.exp(-1.0)])]


def test_gmpo_geometric_mean_of_sign_clipped_ratios():
    # eps 0.4, loss_agg seq-mean-token-mean over 2 sequences:
    #   row 0: A = +1, log-ratios 0.1, 0.6, -0.5: min(x, clip(x)) = 0.1, 0.4, -0.5; mean 0 -> -1 * e^0 = -1
    #          gradient -A * e^0 / 3 where the unclipped x is kept: tokens 0 and 2 (token 1 clipped: 0)
    #   row 1: A = -1, log-ratios 0.5, -0.1 (padding after): max(x, clip(x)) = 0.5, -0.1; mean 0.2
    #          -> +e^0.2; gradient +e^0.2 / 2 on both tokens
    logprobs = torch.tensor([[0.1, 0.6, -0.5], [0.5, -0.1, 9.0]]).requires_grad_()
    batch = {"loss_mask": torch.tensor([[1.0, 1, 1], [1, 1, 0]]), "old_logprobs": torch.zeros(2, 3),
             "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3])}
    cfg = AlgorithmConfig(policy_loss="gmpo", loss_agg="seq-mean-token-mean", gmpo=GMPOConfig(clip_eps=0.4))
    loss, metrics = actor_loss(cfg, logprobs, None, batch, total_tokens=5, total_seqs=2)
    assert loss.item() == pytest.approx((-1 + math.exp(0.2)) / 2, abs=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(3 / 5)  # 0.6, -0.5 and 0.5 lie outside +-0.4
    loss.backward()
    e = math.exp(0.2)
    assert logprobs.grad.tolist() == [pytest.approx([-1 / 3 / 2, 0.0, -1 / 3 / 2], abs=1e-6),
                                      pytest.approx([e / 2 / 2, e / 2 / 2, 0.0], abs=1e-6)]


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # eps_low 1 (no lower bound), eps_high 0.2: ratios 0.5, 1.1, 1.5 -> weights 0.5, 1.1, 1.2 (the last clipped);
    # A = 1, 1, 1 -> loss -w * A * log r; gradient -w * A (PPO's clip would give the 1.5 token none)
    cfg = AlgorithmConfig(cispo=CISPOConfig(clip_eps_low=1.0, clip_eps_high=0.2))
    loss, metrics, grad = run("cispo", [[LN(0.5), LN(1.1), LN(1.5)]], [[1.0, 1.0, 1.0]], cfg)
    assert loss.tolist() == [pytest.approx([-0.5 * LN(0.5), -1.1 * LN(1.1), -1.2 * LN(1.5)], abs=1e-6)]
    assert grad.tolist() == [pytest.approx([-0.5, -1.1, -1.2], abs=1e-6)]
    assert metrics["clipfrac"].tolist() == [[0.0, 0.0, 1.0]]


def test_sapo_smooth_gate():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, loss -f(r) * A; d loss / d log r = -A * 4 s (1 - s) * r
    #   r = 1, A = +1, tau_pos = 1:     f = 0.5 * 4 = 2 -> loss -2, gradient -4 * 0.25 = -1
    #   r = 2, A = -1, tau_neg = 1.05:  s = sigmoid(1.05), f = 4 s / 1.05, loss +f, gradient 4 s (1 - s) * 2
    cfg = AlgorithmConfig(sapo=SAPOConfig(tau_pos=1.0, tau_neg=1.05))
    loss, _, grad = run("sapo", [[0.0, LN(2.0)]], [[1.0, -1.0]], cfg)
    s = sigmoid(1.05)
    assert loss.tolist() == [pytest.approx([-2.0, 4 * s / 1.05], abs=1e-6)]
    assert grad.tolist() == [pytest.approx([-1.0, 4 * s * (1 - s) * 2], abs=1e-5)]


# Covariance losses, one micro-batch of 4 tokens: log p = 0, -2, -2, -2 (mean -1.5), A = 3, -1, -1, -1 (mean 0)
# -> covariance (A - 0)(log p + 1.5) = 4.5, 0.5, 0.5, 0.5: token 0 alone lies in (1, 5) and has the largest.
COV_LOGPROBS = [[0.0, -2.0, -2.0, -2.0]]
COV_ADV = [[3.0, -1.0, -1.0, -1.0]]


def test_clip_cov_cuts_the_gradient_of_a_high_covariance_token():
    # ratio 1 everywhere (old = new): PPO's loss -A = -3, 1, 1, 1; ratio 0.25 of 4 tokens = 1 token cut: token 0
    cfg = AlgorithmConfig(clip_cov=ClipCovConfig(ratio=0.25, lb=1.0, ub=5.0))
    loss, metrics, grad = run("clip_cov", COV_LOGPROBS, COV_ADV, cfg, old=COV_LOGPROBS)
    assert loss.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert grad.tolist() == [pytest.approx([0.0, 1.0, 1.0, 1.0])]
    assert metrics["clipfrac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # with the window (1, 4) no token qualifies: plain PPO
    window = AlgorithmConfig(clip_cov=ClipCovConfig(ub=4.0))
    loss, _, _ = run("clip_cov", COV_LOGPROBS, COV_ADV, window, old=COV_LOGPROBS)
    assert loss.tolist() == [[-3.0, 1.0, 1.0, 1.0]]


def test_clip_cov_draws_the_same_tokens_for_the_same_micro_batch():
    # tokens 0 and 1 both qualify (covariance 2.25 each), one is drawn; the same inputs draw the same one
    cfg = AlgorithmConfig(clip_cov=ClipCovConfig(ratio=0.25))
    args = ([[0.0, 0.0, -2.0, -2.0]], [[1.5, 1.5, -1.5, -1.5]], cfg)
    first = run("clip_cov", *args, old=[[0.0, 0.0, -2.0, -2.0]])[1]["clipfrac"]
    assert first.sum() == 1 and first[0, 2:].sum() == 0
    assert torch.equal(run("clip_cov", *args, old=[[0.0, 0.0, -2.0, -2.0]])[1]["clipfrac"], first)


def test_kl_cov_penalises_the_highest_covariance_tokens():
    # no clipping; token 0 (largest covariance) gets + coef * |log r|: its log-ratio is 0.1 (old = -0.1), so
    # loss -3 e^0.1 + 0.1 * 0.1, gradient -3 e^0.1 + 0.1; the others -A * 1 = 1, gradient 1
    cfg = AlgorithmConfig(kl_cov=KLCovConfig(ratio=0.25, coef=0.1))
    loss, metrics, grad = run("kl_cov", COV_LOGPROBS, COV_ADV, cfg, old=[[-0.1, -2.0, -2.0, -2.0]])
    assert loss.tolist() == [pytest.approx([-3 * math.exp(0.1) + 0.01, 1.0, 1.0, 1.0], abs=1e-6)]
    assert grad.tolist() == [pytest.approx([-3 * math.exp(0.1) + 0.1, 1.0, 1.0, 1.0], abs=1e-6)]
    assert metrics["kl_cov_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_covariance_ignores_padding():
    # a padding column with a huge covariance changes nothing: the same tokens as without it
    cfg = AlgorithmConfig(kl_cov=KLCovConfig(ratio=0.25, coef=0.1))
    padded = run("kl_cov", [COV_LOGPROBS[0] + [50.0]], [COV_ADV[0] + [90.0]], cfg, old=[[-0.1, -2.0, -2.0, -2.0, 0.0]],
                 mask=[[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert padded[1]["kl_cov_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
