import pytest

from megarl.config import ConfigError
from megarl.config.tiny import tiny_config


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.policy_loss=dual_clip", "algorithm.dual_clip.clip_ratio_c=1.0"], "clip_ratio_c=1.0: must be > 1"),
    (["algorithm.loss_agg=seq-mean-token-sum-norm"], "needs algorithm.loss_agg_norm_len >= 1"),
    (["algorithm.tis=true", "algorithm.tis_cap=0"], "tis_cap=0.0: must be > 0"),
    (["algorithm.lam=1.5"], r"algorithm.lam=1.5: must be in \[0, 1\]"),
    (["algorithm.kl_target=0.1"], "an initial kl_coef > 0"),
    (["algorithm.overlong_buffer.len=17", "rollout.max_new_tokens=16"],
     r"must be in \[0, rollout.max_new_tokens=16\]"),
])
def test_inconsistent_algorithm_options_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)


def test_consistent_algorithm_options_load():
    cfg = tiny_config(["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-sum-norm",
                             "algorithm.loss_agg_norm_len=16", "algorithm.tis=true", "algorithm.kl_coef=0.01",
                             "algorithm.kl_target=0.05", "algorithm.overlong_buffer.len=4"])
    assert cfg.algorithm.loss_agg_norm_len == 16 and cfg.algorithm.kl_target == 0.05


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.pf_ppo.method=best"], "algorithm.pf_ppo.method='best': must be one of none, pow, max_min, max_random"),
    (["algorithm.pf_ppo.method=pow", "algorithm.pf_ppo.scope=prompt"], "algorithm.pf_ppo.scope='prompt'"),
    (["algorithm.pf_ppo.replay=4"], "algorithm.pf_ppo.replay > 0 needs algorithm.pf_ppo.method set"),
    (["algorithm.pf_ppo.method=pow", "algorithm.pf_ppo.replay=4"], "needs algorithm.recompute_old_logprobs=always"),
    (["algorithm.gae.critic_warmup_steps=2"], "critic_warmup_steps=2 needs a critic"),
    (["algorithm.advantage=gae", "algorithm.gae.critic_lam=1.5"], r"algorithm.gae.critic_lam=1.5: must be in \[0, 1\]"),
    (["algorithm.positive_lm.coef=-0.1"], "algorithm.positive_lm.coef=-0.1: must be >= 0"),
    (["algorithm.clip_cov.lb=6"], "algorithm.clip_cov.lb=6.0 must be below algorithm.clip_cov.ub=5.0"),
    (["algorithm.kl_cov.ratio=0"], r"algorithm.kl_cov.ratio=0.0: must be in \(0, 1\]"),
    (["algorithm.cispo.clip_eps_low=1.5"], r"algorithm.cispo.clip_eps_low=1.5: must be in \[0, 1\]"),
    (["algorithm.sapo.tau_neg=0"], "algorithm.sapo.tau_neg=0.0: must be > 0"),
    (["algorithm.gmpo.clip_eps=0"], "algorithm.gmpo.clip_eps=0.0: must be > 0"),
    (["algorithm.kl_cov.coef=-1"], "algorithm.kl_cov.coef=-1.0: must be >= 0"),
    (["algorithm.pf_ppo.method=pow", "algorithm.pf_ppo.weight_pow=0"], "algorithm.pf_ppo.weight_pow=0.0: must be > 0"),
    (["algorithm.advantage=gae", "algorithm.gae.lam_length_alpha=-1"],
     "algorithm.gae.lam_length_alpha=-1.0: must be >= 0"),
    (["algorithm.advantage=gae", "algorithm.gae.critic_warmup_steps=-1"],
     "algorithm.gae.critic_warmup_steps=-1: must be >= 0"),
    (["algorithm.advantage=optimal_token_baseline"], "needs algorithm.recompute_old_logprobs=always"),
    (["algorithm.advantage=grpo_passk", "rollout.n_samples=1", "algorithm.allow_single_sample_groups=true"],
     "grpo_passk needs rollout.n_samples >= 2"),
])
def test_inconsistent_estimator_loss_and_filtering_options_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)
