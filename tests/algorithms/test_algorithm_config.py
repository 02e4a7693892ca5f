import pytest

from megarl.config import ConfigError
from megarl.config.tiny import tiny_config


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.policy_loss=dual_clip", "algorithm.clip_ratio_c=1.0"], "clip_ratio_c=1.0: must be > 1"),
    (["algorithm.loss_agg=seq-mean-token-sum-norm"], "needs algorithm.loss_agg_norm_len >= 1"),
    (["algorithm.tis=true", "algorithm.tis_cap=0"], "tis_cap=0.0: must be > 0"),
    (["algorithm.lam=1.5"], r"algorithm.lam=1.5: must be in \[0, 1\]"),
    (["algorithm.kl_target=0.1"], "an initial kl_coef > 0"),
    (["algorithm.overlong_buffer_len=17", "rollout.max_new_tokens=16"],
     r"must be in \[0, rollout.max_new_tokens=16\]"),
])
def test_inconsistent_algorithm_options_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)


def test_consistent_algorithm_options_load():
    cfg = tiny_config(["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-sum-norm",
                             "algorithm.loss_agg_norm_len=16", "algorithm.tis=true", "algorithm.kl_coef=0.01",
                             "algorithm.kl_target=0.05", "algorithm.overlong_buffer_len=4"])
    assert cfg.algorithm.loss_agg_norm_len == 16 and cfg.algorithm.kl_target == 0.05


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.pf_ppo=best"], "algorithm.pf_ppo='best': must be one of none, pow, max_min, max_random"),
    (["algorithm.pf_ppo=pow", "algorithm.pf_ppo_scope=prompt"], "algorithm.pf_ppo_scope='prompt'"),
    (["algorithm.pf_ppo_replay=4"], "algorithm.pf_ppo_replay > 0 needs algorithm.pf_ppo set"),
    (["algorithm.pf_ppo=pow", "algorithm.pf_ppo_replay=4"], "needs algorithm.recompute_old_logprobs=always"),
    (["algorithm.critic_warmup_steps=2"], "critic_warmup_steps=2 needs a critic"),
    (["algorithm.advantage=gae", "algorithm.critic_lam=1.5"], r"algorithm.critic_lam=1.5: must be in \[0, 1\]"),
    (["algorithm.positive_lm_coef=-0.1"], "algorithm.positive_lm_coef=-0.1: must be >= 0"),
    (["algorithm.clip_cov_lb=6"], "algorithm.clip_cov_lb=6.0 must be below algorithm.clip_cov_ub=5.0"),
    (["algorithm.kl_cov_ratio=0"], r"algorithm.kl_cov_ratio=0.0: must be in \(0, 1\]"),
    (["algorithm.cispo_clip_eps_low=1.5"], r"algorithm.cispo_clip_eps_low=1.5: must be in \[0, 1\]"),
    (["algorithm.sapo_tau_neg=0"], "algorithm.sapo_tau_neg=0.0: must be > 0"),
    (["algorithm.gmpo_clip_eps=0"], "algorithm.gmpo_clip_eps=0.0: must be > 0"),
    (["algorithm.kl_cov_coef=-1"], "algorithm.kl_cov_coef=-1.0: must be >= 0"),
    (["algorithm.pf_ppo=pow", "algorithm.pf_ppo_weight_pow=0"], "algorithm.pf_ppo_weight_pow=0.0: must be > 0"),
    (["algorithm.advantage=gae", "algorithm.lam_length_alpha=-1"], "algorithm.lam_length_alpha=-1.0: must be >= 0"),
    (["algorithm.advantage=gae", "algorithm.critic_warmup_steps=-1"], "algorithm.critic_warmup_steps=-1: must be >= 0"),
    (["algorithm.advantage=optimal_token_baseline"], "needs algorithm.recompute_old_logprobs=always"),
    (["algorithm.advantage=grpo_passk", "rollout.n_samples=1", "algorithm.allow_single_sample_groups=true"],
     "grpo_passk needs rollout.n_samples >= 2"),
])
def test_inconsistent_issue_20_options_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)
