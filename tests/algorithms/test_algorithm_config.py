import pytest

from megarl.config import ConfigError, load_config


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
        load_config(None, overrides)


def test_consistent_algorithm_options_load():
    cfg = load_config(None, ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-sum-norm",
                             "algorithm.loss_agg_norm_len=16", "algorithm.tis=true", "algorithm.kl_coef=0.01",
                             "algorithm.kl_target=0.05", "algorithm.overlong_buffer_len=4"])
    assert cfg.algorithm.loss_agg_norm_len == 16 and cfg.algorithm.kl_target == 0.05
