"""Rollout correction, the decoupled PPO objective and the single-sample-group trap; expected values by hand from the
formulas (verl's rollout_corr_helper and AReaL's decoupled loss as their papers and docs state them)."""

import math

import pytest
import torch

from megarl.algorithms import ADVANTAGES, actor_loss
from megarl.algorithms.rollout_correction import apply_rollout_correction, mismatch_metrics
from megarl.config import AlgorithmConfig, ConfigError
from megarl.config.tiny import tiny_config
from megarl.config.correction_checks import GROUP_ESTIMATORS
from megarl.config.sections import RolloutCorrectionConfig
from megarl.protocol import Batch

# Two responses of 3 and 2 tokens; r = pi_old / pi_rollout per token: [3, 1, 0.5] and [1.5, 0.25]
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
R = [[3.0, 1.0, 0.5], [1.5, 0.25]]
ROLLOUT = torch.tensor([[-1.0, -2.0, -1.5, 0.0], [-2.0, -0.5, 0.0, 0.0]])
LOG_R = torch.tensor([[math.log(3.0), 0.0, math.log(0.5), 7.0], [math.log(1.5), math.log(0.25), -9.0, 5.0]])
OLD = ROLLOUT + LOG_R  # padding positions hold junk: nothing may read them
FLAT_R = [r for row in R for r in row]


def batch_of(**extra) -> Batch:
    return Batch({"loss_mask": MASK.clone(), "old_logprobs": OLD.clone(), "rollout_logprobs": ROLLOUT.clone(), **extra})


def corrected(**options) -> tuple[Batch, dict]:
    batch = batch_of()
    return batch, apply_rollout_correction(batch, RolloutCorrectionConfig(**options))


def test_mismatch_metrics_by_hand():
    m = {k.removeprefix("rollout_corr/"): v.item() for k, v in mismatch_metrics(OLD, ROLLOUT, MASK, 5, 2).items()}
    rollout = [[-1.0, -2.0, -1.5], [-2.0, -0.5]]
    old = [[lp + math.log(r) for lp, r in zip(lps, rs)] for lps, rs in zip(rollout, R)]
    mean = [sum(row) / len(row) for row in old], [sum(row) / len(row) for row in rollout]
    diff = [mr - mo for mo, mr in zip(*mean)]
    assert m["kl"] == pytest.approx(-sum(math.log(r) for r in FLAT_R) / 5)
    assert m["k3_kl"] == pytest.approx(sum(r - math.log(r) - 1 for r in FLAT_R) / 5)
    assert m["chi2_token"] == pytest.approx(sum(r * r for r in FLAT_R) / 5 - 1)
    assert m["chi2_seq"] == pytest.approx((1.5**2 + 0.375**2) / 2 - 1)  # products 3 * 1 * 0.5, 1.5 * 0.25
    assert m["training_ppl"] == pytest.approx(sum(math.exp(-x) for x in mean[0]) / 2, rel=1e-6)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(-x) for x in mean[1]) / 2, rel=1e-6)
    assert m["log_ppl_diff"] == pytest.approx(sum(diff) / 2)
    assert m["ppl_ratio"] == pytest.approx((1.5 ** (-1 / 3) + 0.375 ** (-1 / 2)) / 2)


def test_token_weights_truncated_masked_and_batch_normalised():
    batch, m = corrected(rollout_is="token")  # TIS at 2
    assert batch["rollout_is_weights"][MASK > 0].tolist() == pytest.approx([2.0, 1.0, 0.5, 1.5, 0.25])
    assert batch["rollout_is_weights"][MASK == 0].tolist() == [0.0] * 3
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.25 / 5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 3 > 2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # 0.25 < 1 / 2
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.05**2 / (7.5625 / 5))
    assert batch["loss_mask"].equal(MASK)  # no rejection asked
    batch, _ = corrected(rollout_is="token", rollout_is_mode="mask", rollout_is_threshold_lower=0.4)  # IcePop
    assert batch["rollout_is_weights"][MASK > 0].tolist() == pytest.approx([0.0, 1.0, 0.5, 1.5, 0.0])
    batch, m = corrected(rollout_is="token", rollout_is_batch_normalize=True)
    assert batch["rollout_is_weights"][MASK > 0].tolist() == pytest.approx([w / 1.05 for w in (2, 1, 0.5, 1.5, 0.25)])
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.05)


def test_sequence_weights_are_the_product_over_the_response():
    batch, m = corrected(rollout_is="sequence", rollout_is_threshold=1.2)  # products 1.5 (truncated) and 0.375
    assert batch["rollout_is_weights"].flatten().tolist() == pytest.approx([1.2] * 3 + [0.0] + [0.375] * 2 + [0.0] * 2)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5  # of the sequences
    batch, m = corrected(rollout_is="sequence", rollout_is_batch_normalize=True)  # mean over sequences 0.9375
    assert batch["rollout_is_weights"][MASK > 0].tolist() == pytest.approx([1.6] * 3 + [0.4] * 2)


@pytest.mark.parametrize("mode, kept, tokens, seqs", [
    ("token_k1", [[0, 1, 1, 0], [1, 0, 0, 0]], 2 / 5, 1.0),  # 3 and 0.25 leave [0.5, 2]; 0.5 is inside
    ("seq_sum_k1", [[1, 1, 1, 0], [0, 0, 0, 0]], 2 / 5, 0.5),  # products 1.5 (in) and 0.375 (out)
    ("seq_mean_k1", [[1, 1, 1, 0], [1, 1, 0, 0]], 0.0, 0.0),  # geometric means 1.145 and 0.612: both in
])
def test_rejection_removes_tokens_or_sequences_from_the_loss_mask(mode, kept, tokens, seqs):
    batch, m = corrected(rollout_rs=mode)
    assert batch["loss_mask"].tolist() == kept
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(tokens)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seqs)


# ---- in the loss ------------------------------------------------------------------------------------


def loss_inputs(advantages: list[float]):
    """A micro-batch of the 5 response tokens above; the policy moved from pi_old by log ratios DELTA."""
    delta = torch.tensor([[0.1, -0.3, 0.05, 0.0], [0.3, 0.0, 0.0, 0.0]])
    logprobs = (OLD + delta).requires_grad_()
    adv = torch.tensor([advantages[:3] + [0.0], advantages[3:] + [0.0, 0.0]])
    mb = {"loss_mask": MASK, "old_logprobs": OLD, "rollout_logprobs": ROLLOUT, "advantages": adv}
    return logprobs, mb, delta, adv


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_capped_behaviour_ratio():
    """Hilton et al. 2022 / AReaL: loss_t = w_t * max(-A r_t, -A clip(r_t)), r = pi / pi_prox,
    w = pi_prox / pi_behav capped (truncate: min(w, cap); mask: 0 above the cap)."""
    advantages = [1.0, -1.0, 2.0, 1.0, -0.5]
    for mode, w in (("truncate", [2.0, 1.0, 0.5, 1.5, 0.25]), ("mask", [0.0, 1.0, 0.5, 1.5, 0.25])):
        logprobs, mb, delta, _ = loss_inputs(advantages)
        rc = RolloutCorrectionConfig(decoupled=True, decoupled_cap=2.0, decoupled_cap_mode=mode)
        cfg = AlgorithmConfig(clip_eps=0.2, rollout_correction=rc)
        loss, metrics = actor_loss(cfg, logprobs, None, mb, total_tokens=5, total_seqs=2)
        r = [math.exp(d) for d in delta[MASK > 0].tolist()]  # 1.105, 0.741 (clipped, A < 0), 1.051, 1.35 (clipped), 1
        per_token = [wt * max(-a * rt, -a * min(max(rt, 0.8), 1.2)) for wt, a, rt in zip(w, advantages, r)]
        assert loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-6)
        loss.backward()
        # unclipped tokens: d loss / d logprob = -A * w * r / 5; clipped ones (0.741 with A < 0, 1.35 with A > 0): 0
        unclipped = [1, 0, 1, 0, 1]
        expected = [-a * wt * rt * u / 5 for a, wt, rt, u in zip(advantages, w, r, unclipped)]
        assert logprobs.grad[MASK > 0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert metrics["decoupled_weight"].item() == pytest.approx(sum(w) / 5)
        assert metrics["decoupled_capped"].item() == pytest.approx(1 / 5)


def test_bypass_mode_reinforce_weights_the_policy_gradient_by_the_truncated_ratio_to_the_rollout():
    """verl's bypass mode, loss_type reinforce: loss = -sg(w) * A * log pi, w = min(pi / pi_rollout, 2), the old
    log-probs being the rollout's; token_k1 rejection drops tokens whose ratio leaves [0.5, 2]."""
    advantages = [1.0, -1.0, 2.0, 1.0, -0.5]
    logprobs, mb, delta, adv = loss_inputs(advantages)
    mb = dict(mb, old_logprobs=ROLLOUT)  # the trainer's bypass: old := rollout
    rc = RolloutCorrectionConfig(bypass_mode=True, rollout_is="token", rollout_rs="token_k1")
    cfg = AlgorithmConfig(policy_loss="reinforce", rollout_correction=rc)
    loss, metrics = actor_loss(cfg, logprobs, None, mb, total_tokens=5, total_seqs=2)
    ratio = [r * math.exp(d) for r, d in zip(FLAT_R, delta[MASK > 0].tolist())]  # 3.32, 0.74, 0.53, 2.02, 0.25
    kept = [0.5 <= x <= 2.0 for x in ratio]  # the 1st, 4th and 5th tokens are rejected
    w = [min(x, 2.0) for x in ratio]
    lp = logprobs[MASK > 0].tolist()
    assert loss.item() == pytest.approx(sum(-a * wt * p * k for a, wt, p, k in zip(advantages, w, lp, kept)) / 5)
    loss.backward()
    assert logprobs.grad[MASK > 0].tolist() == pytest.approx([-a * wt * k / 5 for a, wt, k in zip(advantages, w, kept)])
    assert metrics["rollout_rs_rejected"].item() == pytest.approx(3 / 5)


def test_driver_weights_multiply_the_policy_loss():
    # PPO-clip (eps 0.2) times the driver's weights w: d loss / d logprob = -A * w * r / 5 where unclipped; the
    # ratios r = e^delta are 1.105, 0.741 (clipped, A < 0), 1.051, 1.35 (clipped, A > 0), 1
    advantages, w = [1.0, -1.0, 2.0, 1.0, -0.5], [2.0, 1.0, 0.5, 1.5, 0.25]
    logprobs, mb, delta, _ = loss_inputs(advantages)
    weights = torch.tensor([w[:3] + [0.0], w[3:] + [0.0, 0.0]])
    cfg = AlgorithmConfig(clip_eps=0.2, rollout_correction=RolloutCorrectionConfig(rollout_is="token"))
    loss, metrics = actor_loss(cfg, logprobs, None, dict(mb, rollout_is_weights=weights), 5, 2)
    r = [math.exp(d) for d in delta[MASK > 0].tolist()]
    expected = [-a * wt * rt * u / 5 for a, wt, rt, u in zip(advantages, w, r, [1, 0, 1, 0, 1])]
    assert torch.autograd.grad(loss, logprobs)[0][MASK > 0].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert metrics["rollout_is_weight"].item() == pytest.approx(5.25 / 5)


# ---- config -----------------------------------------------------------------------------------------


def test_every_registered_estimator_that_gives_a_lone_sample_nothing_is_refused_at_one_sample():
    """The trap: with rollout.n_samples=1 a group estimator's advantages are all 0. Behaviour decides which
    estimators are group estimators: lone samples with different rewards, each in its own group."""
    mask = torch.ones(4, 3)
    batch = Batch({"rewards": torch.tensor([1.0, 0.0, 2.0, -1.0]), "loss_mask": mask, "values": torch.zeros(4, 3),
                   "baseline_rewards": torch.zeros(4), "old_logprobs": -torch.ones(4, 3),
                   "ref_logprobs": -torch.ones(4, 3), "sum_pi_squared": torch.full((4, 3), 0.5)},
                  {"group": [0, 1, 2, 3]})
    for name in ADVANTAGES.names():
        try:
            lone_is_zero = bool((ADVANTAGES.get(name)(batch, AlgorithmConfig(advantage=name)) == 0).all())
        except ValueError as e:  # grpo_passk refuses a group of one outright
            assert "per group" in str(e), name
            lone_is_zero = True
        assert lone_is_zero == (name in GROUP_ESTIMATORS), name
        overrides = [f"algorithm.advantage={name}", "rollout.n_samples=1", "data.prompts_per_step=4"]
        if name == "optimal_token_baseline":  # its sum of p^2 comes from the old log-probs' forward
            overrides.append("algorithm.recompute_old_logprobs=always")
        if lone_is_zero:
            with pytest.raises(ConfigError, match=rf"algorithm\.advantage={name}.*rollout\.n_samples|rollout\.n_samples=1 "
                                                  rf"with algorithm\.advantage={name}"):
                tiny_config(overrides)
            if name != "grpo_passk":  # its own check needs 2 samples whatever this says
                tiny_config(overrides + ["algorithm.allow_single_sample_groups=true"])
        else:
            tiny_config(overrides)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.kl_estimator=k5+"], "algorithm.kl_estimator='k5\\+'"),
    (["algorithm.kl_clamp=-1"], "algorithm.kl_clamp=-1.0"),
    (["algorithm.rollout_correction.rollout_rs=token_k2"], "rollout_rs='token_k2'"),
    (["algorithm.rollout_correction.rollout_rs_threshold=2", "algorithm.rollout_correction.rollout_rs_threshold_lower=3"],
     "rollout_rs_threshold_lower=3.0"),
    (["algorithm.rollout_correction.rollout_is_threshold_lower=0.5"], "rollout_is_mode=mask only"),
    (["algorithm.rollout_correction.decoupled=true", "algorithm.tis=true"], "decoupled=true with algorithm.tis"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"],
     "policy_loss=reinforce"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.policy_loss=reinforce",
      "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_batch_normalize=true"],
     "micro-batch by micro-batch"),
    (["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.recompute_old_logprobs=never"],
     "recompute_old_logprobs=never cannot give them"),
])
def test_bad_rollout_correction_options_name_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)


def test_where_the_old_logprobs_come_from():
    one_update = ["data.prompts_per_step=4", "rollout.n_samples=2"]
    assert not tiny_config(one_update).recompute_old_logprobs()  # the update's own forward
    # the driver's weights and rejection need them before training; bypass mode takes the rollout's
    assert tiny_config(one_update + ["algorithm.rollout_correction.rollout_rs=seq_mean_k1"]).recompute_old_logprobs()
    bypass = tiny_config(one_update + ["actor.ppo_epochs=2", "algorithm.rollout_correction.bypass_mode=true"])
    assert not bypass.recompute_old_logprobs()
