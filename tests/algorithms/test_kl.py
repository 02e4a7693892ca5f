import math

import pytest
import torch

from megarl.algorithms import AdaptiveKLController, FixedKLController, kl_controller, kl_in_reward, kl_penalty
from megarl.config import AlgorithmConfig


def test_kl_estimators_hand_values():
    x = torch.tensor([0.0, 1.0, -1.0, 2.0])  # logprob - ref_logprob
    ref = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    lp = ref + x
    assert kl_penalty(lp, ref, "k1", clamp=10.0).tolist() == pytest.approx([0.0, 1.0, -1.0, 2.0])
    assert kl_penalty(lp, ref, "k2", clamp=10.0).tolist() == pytest.approx([0.0, 0.5, 0.5, 2.0])
    # k3 = exp(-x) + x - 1: 0; e^-1 = 0.367879; e - 2 = 0.718282; e^-2 + 1 = 1.135335
    assert kl_penalty(lp, ref, "k3", clamp=10.0).tolist() == pytest.approx([0.0, 0.367879, 0.718282, 1.135335], abs=1e-6)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(lp, ref, "k4", clamp=10.0)


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    # Expectation under the policy p, taken exactly over a 5-token vocabulary: E_p[k1] = E_p[k3] = KL(p || ref)
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    kl = (p * (p / ref).log()).sum().item()
    for estimator in ("k1", "k3"):
        estimate = (p * kl_penalty(p.log(), ref.log(), estimator, clamp=0.0).double()).sum().item()
        assert estimate == pytest.approx(kl, rel=1e-5)


def test_kl_in_reward_subtracts_the_penalty_on_response_tokens_only():
    # k2, coef 0.1: log-ratios 1 and -2 give KL 0.5 and 2; the masked position keeps neither reward nor KL
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    logprobs = ref + torch.tensor([[1.0, -2.0, 3.0]])
    shaped, kl = kl_in_reward(rewards, logprobs, ref, torch.tensor([[1.0, 1.0, 0.0]]), 0.1, "k2", 10.0)
    assert shaped.tolist() == [pytest.approx([-0.05, 1.0 - 0.2, 0.0])]
    assert kl.tolist() == [[0.5, 2.0, 0.0]]


def test_adaptive_kl_controller_follows_the_proportional_rule():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 8: error = clip(8 / 6 - 1 = 0.333, -0.2, 0.2) = 0.2; coef *= 1 + 0.2 * 256 / 10000 = 1.00512
    assert ctl.update(8.0, 256) == pytest.approx(0.100512)
    # KL 6.6: error 0.1 (inside the clip); coef *= 1.00256
    assert ctl.update(6.6, 256) == pytest.approx(0.100512 * 1.00256)
    # KL 3: error clip(-0.5) = -0.2; coef *= 0.99488
    assert ctl.update(3.0, 256) == pytest.approx(0.100512 * 1.00256 * 0.99488)
    # on target: unchanged
    assert ctl.update(6.0, 256) == pytest.approx(0.100512 * 1.00256 * 0.99488)

    restored = AdaptiveKLController(0.5, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="target and horizon > 0"):
        AdaptiveKLController(0.1, 0.0, 10000)


def test_kl_controller_from_config():
    fixed = kl_controller(AlgorithmConfig(kl_coef=0.05))
    assert type(fixed) is FixedKLController and fixed.update(100.0, 64) == 0.05
    adaptive = kl_controller(AlgorithmConfig(kl_coef=0.05, kl_target=0.1, kl_horizon=1000))
    assert isinstance(adaptive, AdaptiveKLController)
    # KL 0.05 is half the target: error -0.2 (clipped from -0.5); 0.05 * (1 - 0.2 * 100 / 1000) = 0.049
    assert adaptive.update(0.05, 100) == pytest.approx(0.049)


def test_k3_is_clamped_by_default_and_abs_and_verl_names():
    # x = lp - ref = -20: k3 = e^20 - 21 = 4.85e8 (a drifted token seen in a run); capped at 10 it has no gradient
    lp = torch.tensor([-21.0, -1.5], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    k3 = kl_penalty(lp, ref, "k3", clamp=10.0)
    assert k3.tolist() == pytest.approx([10.0, math.exp(0.5) - 0.5 - 1])
    assert kl_penalty(lp, ref, "k3", clamp=0.0)[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    k3.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 1 - math.exp(0.5)])  # d/dx (e^-x + x - 1) = 1 - e^-x
    assert kl_penalty(lp, ref, "abs", clamp=10.0).tolist() == pytest.approx([20.0, 0.5])
    for verl_name, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_penalty(lp, ref, verl_name, clamp=10.0), kl_penalty(lp, ref, name, clamp=10.0))


@pytest.mark.parametrize("estimator, value_of", [
    ("k1+", lambda x: x), ("k2+", lambda x: x * x / 2), ("k3+", lambda x: math.exp(-x) + x - 1),
    ("low_var_kl+", lambda x: math.exp(-x) + x - 1), ("abs+", abs)])
def test_straight_through_variants_have_the_value_of_their_estimator_and_the_gradient_of_k2(estimator, value_of):
    x = [0.7, -1.2, 0.0, 2.5]  # lp - ref; k3 stays below the clamp (e^1.2 - 2.2 = 1.12)
    ref = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    lp = (ref + torch.tensor(x)).requires_grad_()
    value = kl_penalty(lp, ref, estimator, clamp=10.0)
    assert value.tolist() == pytest.approx([value_of(v) for v in x], abs=1e-6)
    value.sum().backward()
    assert lp.grad.tolist() == pytest.approx(x, abs=1e-6)  # d/dlp of (lp - ref)^2 / 2
