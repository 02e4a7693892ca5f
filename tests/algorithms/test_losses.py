import math

import pytest
import torch

from megarl.algorithms import actor_loss, aggregate, sft_loss
from megarl.algorithms.losses import POLICY_LOSSES
from megarl.config import AlgorithmConfig
from megarl.config.knob_sections import DualClipConfig, GSPOConfig, PositiveLMConfig

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


def test_clip_higher_leaves_the_lower_side_for_negative_advantages():
    # A = -1, eps_low 0.2, eps_high 0.28: r = 0.7 -> max(0.7, 0.8) = 0.8 clipped at the unchanged lower side;
    # r = 1.25 -> 1.25 and r = 1.5 -> max(1.5, 1.28) = 1.5: the pessimistic side, not clipped.
    ratios = torch.tensor([[0.7, 1.25, 1.5]])
    cfg = AlgorithmConfig(clip_eps=0.2, clip_eps_high=0.28)
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(ratios.log(), {"old_logprobs": torch.zeros(1, 3),
                                                                 "advantages": -torch.ones(1, 3)}, cfg)
    assert loss[0].tolist() == pytest.approx([0.8, 1.25, 1.5], abs=1e-6)
    assert metrics["clipfrac"][0].tolist() == [1, 0, 0]


def test_dual_clip_caps_negative_advantage_losses():
    # clip_eps 0.2, dual_clip.clip_ratio_c 3:
    #   A=-1, r=5:   max(5, 1.2) = 5, then min(5, -A * 3 = 3) = 3   dual-clipped: no gradient
    #   A=-1, r=2:   max(2, 1.2) = 2 < 3                             kept: d/dlogprob = -A * r = 2
    #   A=-1, r=0.5: max(0.5, 0.8) = 0.8                             ordinary clip: no gradient
    #   A=+2, r=5:   max(-10, -2.4) = -2.4                           positive advantages are left alone
    ratios = torch.tensor([[5.0, 2.0, 0.5, 5.0]])
    logprobs = ratios.log().requires_grad_()
    batch = {"old_logprobs": torch.zeros(1, 4), "advantages": torch.tensor([[-1.0, -1.0, -1.0, 2.0]])}
    cfg = AlgorithmConfig(clip_eps=0.2, dual_clip=DualClipConfig(clip_ratio_c=3.0))
    loss, metrics = POLICY_LOSSES.get("dual_clip")(logprobs, batch, cfg)
    assert loss[0].tolist() == pytest.approx([3.0, 2.0, 0.8, -2.4], abs=1e-5)
    assert metrics["dual_clipfrac"][0].tolist() == [1, 0, 0, 0]
    assert metrics["clipfrac"][0].tolist() == [0, 0, 1, 1]
    loss.sum().backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0, 0.0], abs=1e-5)
    # plain ppo_clip keeps the unbounded 5
    assert POLICY_LOSSES.get("ppo_clip")(logprobs, batch, cfg)[0][0, 0].item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="dual_clip.clip_ratio_c > 1"):
        POLICY_LOSSES.get("dual_clip")(logprobs, batch, AlgorithmConfig(dual_clip=DualClipConfig(clip_ratio_c=1.0)))


# GSPO, clip range 0.2 on both sides, loss_agg seq-mean-token-mean, 4 sequences (9.0 = junk padding):
#   row 0: A=+1, token ratios 1.21, 1      -> s = exp((ln 1.21 + 0) / 2) = 1.1  -> max(-1.1, -1.1) = -1.1
#   row 1: A=+1, token ratios 4, 1, 2      -> s = exp(ln 8 / 3) = 2              -> max(-2, -1.2) = -1.2 clipped
#   row 2: empty response                  -> contributes 0
#   row 3: A=-1, token ratio 0.5           -> s = 0.5                           -> max(0.5, 0.8) = 0.8 clipped
GSPO_RATIOS = torch.tensor([[1.21, 1.0, 9.0], [4.0, 1.0, 2.0], [9.0, 9.0, 9.0], [0.5, 9.0, 9.0]])
GSPO_MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
GSPO_ADV = torch.tensor([[1.0] * 3, [1.0] * 3, [1.0] * 3, [-1.0] * 3])


def test_gspo_sequence_ratio_loss_and_gradient():
    logprobs = GSPO_RATIOS.log().requires_grad_()
    batch = {"loss_mask": GSPO_MASK, "old_logprobs": torch.zeros(4, 3), "advantages": GSPO_ADV}
    cfg = AlgorithmConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean",
                          gspo=GSPOConfig(clip_eps=0.2, clip_eps_high=0.2))
    loss, metrics = actor_loss(cfg, logprobs, None, batch, total_tokens=6, total_seqs=4)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0 + 0.8) / 4, abs=1e-5)
    # token means over the 6 trained tokens: ratio (1.1 * 2 + 2 * 3 + 0.5) / 6, clipfrac (3 + 1) / 6
    assert metrics["ratio"].item() == pytest.approx(8.7 / 6, abs=1e-5)
    assert metrics["clipfrac"].item() == pytest.approx(4 / 6)
    loss.backward()
    # row 0 is the only unclipped sequence: d(-s)/d logprob_t = -s / |y| = -1.1 / 2, over 4 sequences
    expected = torch.zeros(4, 3)
    expected[0, :2] = -1.1 / 2 / 4
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)


def test_gspo_gradient_uses_each_tokens_own_advantage():
    # per-token advantages (GAE, REINFORCE++ with gamma < 1), clip 0.2, seq-mean-token-mean over 2 sequences:
    #   row 0: ratios 1.21, 1 -> s = 1.1 (inside); A = +2, -1 -> losses -2.2, 1.1, sequence mean -0.55
    #   row 1: ratios 2, 2    -> s = 2 (above 1.2); A = +1 -> max(-2, -1.2) = -1.2 clipped, A = -1 -> 2 kept;
    #          sequence mean 0.4
    # verl's per-token GSPO: token t's gradient is -A_t * s / |y| / (2 sequences) where unclipped:
    #   row 0: -2 * 1.1 / 2 / 2 = -0.55 and +1 * 1.1 / 2 / 2 = 0.275; row 1: 0 and +1 * 2 / 2 / 2 = 0.5
    # (a sequence-mean advantage would give row 0 -0.5 * 1.1 / 2 / 2 = -0.1375 on both tokens)
    logprobs = torch.tensor([[1.21, 1.0], [2.0, 2.0]]).log().requires_grad_()
    batch = {"loss_mask": torch.ones(2, 2), "old_logprobs": torch.zeros(2, 2),
             "advantages": torch.tensor([[2.0, -1.0], [1.0, -1.0]])}
    cfg = AlgorithmConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean",
                          gspo=GSPOConfig(clip_eps=0.2, clip_eps_high=0.2))
    loss, metrics = actor_loss(cfg, logprobs, None, batch, total_tokens=4, total_seqs=2)
    assert loss.item() == pytest.approx((-0.55 + 0.4) / 2, abs=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 4)
    loss.backward()
    assert logprobs.grad.tolist() == [pytest.approx([-0.55, 0.275], abs=1e-6), pytest.approx([0.0, 0.5], abs=1e-6)]


def test_positive_example_lm_loss_adds_the_nll_of_correct_samples():
    # VAPO, mu = 0.1: row 0 is the correct sample (lm_mask), its 3 response tokens have log-probs
    # ln 1.1, -1 + ln 1.5, -2 + ln 0.5; NLL = -(their sum) / 3 positive tokens; PPO's part is -2.2 / 6 (above)
    lm_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    nll = -(LN(1.1) - 1 + LN(1.5) - 2 + LN(0.5)) / 3
    logprobs = NEW.clone().requires_grad_()
    cfg = AlgorithmConfig(clip_eps=0.2, positive_lm=PositiveLMConfig(coef=0.1))
    loss, metrics = actor_loss(cfg, logprobs, None, mb(lm_mask=lm_mask), 6, 2, total_lm_tokens=3)
    assert metrics["positive_lm_nll"].item() == pytest.approx(nll, abs=1e-5)
    assert loss.item() == pytest.approx(-2.2 / 6 + 0.1 * nll, abs=1e-5)
    loss.backward()
    # PPO's gradient (test above) plus -mu / 3 on each positive token
    expected = torch.tensor([[-2 * 1.1, 0.0, -2 * 0.5, 0.0], [1.1, 1.5, 0.0, 0.0]]) / 6
    expected[0, :3] -= 0.1 / 3
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    with pytest.raises(KeyError, match="lm_mask"):
        actor_loss(cfg, NEW, None, mb(), 6, 2, total_lm_tokens=3)


def test_gspo_uses_its_own_narrow_clip_range():
    # defaults 3e-4 / 4e-4, not clip_eps: s = 1.1 with A = +1 is clipped to 1.0004; s = 0.9 with A = -1 to 0.9997
    logprobs = torch.tensor([[1.1, 1.1], [0.9, 0.9]]).log()
    batch = {"loss_mask": torch.ones(2, 2), "old_logprobs": torch.zeros(2, 2),
             "advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]])}
    loss, _ = POLICY_LOSSES.get("gspo")(logprobs, batch, AlgorithmConfig(clip_eps=0.2))
    assert loss.tolist() == [pytest.approx([-1.0004] * 2, abs=1e-6), pytest.approx([0.9997] * 2, abs=1e-6)]


def test_truncated_importance_sampling_weights_the_policy_loss():
    # raw weights exp(old - rollout): row 0: 0.5, 3, 1.5; row 1: 1, 2.5, 0.25; capped at 2 -> 0.5, 2, 1.5 | 1, 2, 0.25
    # per-token PPO loss times weight: -2.2 * 0.5, -2.4 * 2, -1.0 * 1.5 | 1.1 * 1, 1.5 * 2, 0.8 * 0.25
    #   = -1.1, -4.8, -1.5 | 1.1, 3.0, 0.2; token mean -3.1 / 6
    raw = torch.tensor([[0.5, 3.0, 1.5, 1.0], [1.0, 2.5, 0.25, 1.0]])
    logprobs = NEW.clone().requires_grad_()
    cfg = AlgorithmConfig(clip_eps=0.2, tis=True, tis_cap=2.0)
    loss, metrics = actor_loss(cfg, logprobs, None, mb(rollout_logprobs=OLD - raw.log()), 6, 2)
    assert loss.item() == pytest.approx(-3.1 / 6, abs=1e-5)
    assert metrics["tis_weight"].item() == pytest.approx(7.25 / 6)
    loss.backward()
    # the weight is a constant: the unclipped PPO gradients (-A * r) times the weight
    expected = torch.tensor([[-2 * 1.1 * 0.5, 0.0, -2 * 0.5 * 1.5, 0.0], [1.1 * 1, 1.5 * 2, 0.0, 0.0]]) / 6
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    with pytest.raises(KeyError, match="no 'rollout_logprobs'"):
        actor_loss(cfg, NEW, None, mb(), 6, 2)


def test_kl_in_reward_leaves_the_kl_out_of_the_loss():
    cfg = AlgorithmConfig(clip_eps=0.2, kl_coef=0.5, kl_in_reward=True)
    loss, metrics = actor_loss(cfg, NEW, None, mb(), 6, 2)  # no ref_logprobs needed
    assert loss.item() == pytest.approx(-2.2 / 6, abs=1e-5) and "kl" not in metrics


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
    ("seq-mean-token-sum-norm", 18 / 20, 7 / 20),   # (3 + 15 + 7 + 0) / 5 / 4 = 1.25 (norm length 5)
])
def test_aggregation_contributions_sum_to_the_global_mean(mode, first, second):
    cfg = AlgorithmConfig(loss_agg_norm_len=5)
    parts = [aggregate(VALUES[rows], AGG_MASK[rows], mode, total_tokens=6, total_seqs=4, cfg=cfg)
             for rows in (slice(0, 2), slice(2, 4))]
    assert [p.item() for p in parts] == pytest.approx([first, second])
    whole = aggregate(VALUES, AGG_MASK, mode, total_tokens=6, total_seqs=4, cfg=cfg)
    assert whole.item() == pytest.approx(first + second)


def test_seq_mean_token_sum_norm_needs_its_length():
    with pytest.raises(ValueError, match="needs algorithm.loss_agg_norm_len >= 1"):
        aggregate(VALUES, AGG_MASK, "seq-mean-token-sum-norm", 6, 4, AlgorithmConfig())


def test_aggregation_ignores_non_finite_padding_and_names_unknown_modes():
    values = torch.tensor([[1.0, float("nan"), float("inf")]])
    assert aggregate(values, torch.tensor([[1.0, 0, 0]]), "token-mean", 1, 1).item() == 1.0
    with pytest.raises(KeyError, match="did you mean 'token-mean'"):
        aggregate(values, torch.ones(1, 3), "token_mean", 1, 1)


@pytest.mark.parametrize("policy_loss, loss_agg, tis", [
    ("ppo_clip", "token-mean", False),
    ("dual_clip", "seq-mean-token-mean", True),
    ("gspo", "seq-mean-token-sum-norm", True),
])
def test_actor_loss_micro_batches_sum_to_full_batch_with_kl_and_entropy(policy_loss, loss_agg, tis):
    torch.manual_seed(0)
    b, t = 6, 5
    old = -torch.rand(b, t) * 3
    new = old + 0.3 * torch.randn(b, t)
    mask = (torch.rand(b, t) > 0.3).float()
    mask[4] = 0  # an empty response
    batch = {"loss_mask": mask, "old_logprobs": old, "rollout_logprobs": old + 0.5 * torch.randn(b, t),
             "advantages": torch.randn(b, 1).expand(b, t).contiguous(), "ref_logprobs": old + 0.2 * torch.randn(b, t)}
    entropy = torch.rand(b, t)
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, policy_loss=policy_loss,
                          loss_agg=loss_agg, tis=tis, loss_agg_norm_len=t,
                          gspo=GSPOConfig(clip_eps=0.2, clip_eps_high=0.2))
    tokens, seqs = batch["loss_mask"].sum().item(), float(b)

    full_lp = new.clone().requires_grad_()
    full_loss, full_metrics = actor_loss(cfg, full_lp, entropy, batch, tokens, seqs)
    full_loss.backward()
    # the loss is exactly its reported terms
    expected = full_metrics["pg_loss"] + 0.1 * full_metrics["kl"] - 0.01 * full_metrics["entropy"]
    assert full_loss.item() == pytest.approx(expected.item(), abs=1e-6)
    if loss_agg == "token-mean":  # kl and entropy metrics are then the masked token means
        k3 = torch.exp(batch["ref_logprobs"] - new) - (batch["ref_logprobs"] - new) - 1
        assert full_metrics["kl"].item() == pytest.approx(((k3 * mask).sum() / tokens).item(), abs=1e-6)
        assert full_metrics["entropy"].item() == pytest.approx(((entropy * mask).sum() / tokens).item(), abs=1e-6)
    assert ("tis_weight" in full_metrics) == tis

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
    assert (full_lp.grad[4] == 0).all() and full_lp.grad.abs().sum() > 0


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


def test_bradley_terry_by_hand_a_tie_counts_half():
    """One pair won (margin 1), one tied, one lost (margin -1): accuracy (1 + 0.5 + 0) / 3, as the held-out
    pair_metrics count it; loss the mean of -log sigmoid(margin); margin 0."""
    from megarl.algorithms.losses import bradley_terry_loss

    loss, metrics = bradley_terry_loss(torch.tensor([2.0, 0.5, 0.0]), torch.tensor([1.0, 0.5, 1.0]), 3)
    expected = (math.log1p(math.exp(-1.0)) + math.log(2.0) + math.log1p(math.exp(1.0))) / 3
    assert metrics["accuracy"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-6) and metrics["margin"].item() == pytest.approx(0.0)
