"""The checks of the algorithm options issue 20 added (VAPO, PF-PPO, the estimators and losses of the field);
each raises a ConfigError that names the key. Called from ConfigChecks.validate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config.validation import ConfigError

if TYPE_CHECKING:
    from megarl.config.sections import Config

PF_PPO_MODES = ("none", "pow", "max_min", "max_random")
PF_PPO_SCOPES = ("batch", "group")


def check_algorithm_extras(cfg: "Config") -> None:
    a = cfg.algorithm
    _check_vapo(cfg)
    _check_pf_ppo(cfg)
    for key, value in (("algorithm.gmpo_clip_eps", a.gmpo_clip_eps), ("algorithm.sapo_tau_pos", a.sapo_tau_pos),
                       ("algorithm.sapo_tau_neg", a.sapo_tau_neg)):
        if value <= 0:
            raise ConfigError(f"{key}={value}: must be > 0")
    if not 0 <= a.cispo_clip_eps_low <= 1 or a.cispo_clip_eps_high < 0:
        raise ConfigError(f"algorithm.cispo_clip_eps_low={a.cispo_clip_eps_low} must be in [0, 1] and "
                          f"algorithm.cispo_clip_eps_high={a.cispo_clip_eps_high} >= 0")
    for key, value in (("algorithm.clip_cov_ratio", a.clip_cov_ratio), ("algorithm.kl_cov_ratio", a.kl_cov_ratio)):
        if not 0 < value <= 1:
            raise ConfigError(f"{key}={value}: must be in (0, 1]")
    if a.clip_cov_lb >= a.clip_cov_ub:
        raise ConfigError(f"algorithm.clip_cov_lb={a.clip_cov_lb} must be below algorithm.clip_cov_ub={a.clip_cov_ub}")
    if a.kl_cov_coef < 0:
        raise ConfigError(f"algorithm.kl_cov_coef={a.kl_cov_coef}: must be >= 0")
    if a.advantage == "optimal_token_baseline" and a.recompute_old_logprobs != "always":
        raise ConfigError("algorithm.advantage=optimal_token_baseline needs algorithm.recompute_old_logprobs=always: "
                          "the forward pass of the old log-probs also gives its sum over the vocabulary of p^2")
    if a.advantage == "grpo_passk" and cfg.rollout.n_samples < 2:
        raise ConfigError(f"algorithm.advantage=grpo_passk needs rollout.n_samples >= 2 (the best response's "
                          f"advantage is its lead over the second best); got {cfg.rollout.n_samples}")


def _check_vapo(cfg: "Config") -> None:
    a = cfg.algorithm
    if a.critic_lam != -1 and not 0 <= a.critic_lam <= 1:
        raise ConfigError(f"algorithm.critic_lam={a.critic_lam}: must be in [0, 1], or -1 for algorithm.lam")
    if a.lam_length_alpha < 0:
        raise ConfigError(f"algorithm.lam_length_alpha={a.lam_length_alpha}: must be >= 0 (0 = off)")
    if a.critic_warmup_steps < 0:
        raise ConfigError(f"algorithm.critic_warmup_steps={a.critic_warmup_steps}: must be >= 0")
    if a.advantage != "gae":
        for key, value, off in (("algorithm.critic_warmup_steps", a.critic_warmup_steps, 0),
                                ("algorithm.lam_length_alpha", a.lam_length_alpha, 0),
                                ("algorithm.critic_lam", a.critic_lam, -1)):
            if value != off:
                raise ConfigError(f"{key}={value} needs a critic (algorithm.advantage=gae), not "
                                  f"algorithm.advantage={a.advantage}")
    if a.positive_lm_coef < 0:
        raise ConfigError(f"algorithm.positive_lm_coef={a.positive_lm_coef}: must be >= 0 (0 = off)")


def _check_pf_ppo(cfg: "Config") -> None:
    a = cfg.algorithm
    if a.pf_ppo not in PF_PPO_MODES:
        raise ConfigError(f"algorithm.pf_ppo={a.pf_ppo!r}: must be one of {', '.join(PF_PPO_MODES)}")
    if a.pf_ppo_scope not in PF_PPO_SCOPES:
        raise ConfigError(f"algorithm.pf_ppo_scope={a.pf_ppo_scope!r}: must be one of {', '.join(PF_PPO_SCOPES)}")
    if a.pf_ppo_weight_pow <= 0:
        raise ConfigError(f"algorithm.pf_ppo_weight_pow={a.pf_ppo_weight_pow}: must be > 0")
    if a.pf_ppo_replay < 0:
        raise ConfigError(f"algorithm.pf_ppo_replay={a.pf_ppo_replay}: must be >= 0 (0 = no replay)")
    if a.pf_ppo_replay and (a.pf_ppo == "none" or not a.pf_ppo_resample):
        raise ConfigError("algorithm.pf_ppo_replay > 0 needs algorithm.pf_ppo set and algorithm.pf_ppo_resample=true "
                          "(replayed samples are drawn beside the step's)")
    if a.pf_ppo_replay and a.recompute_old_logprobs != "always":
        raise ConfigError("algorithm.pf_ppo_replay > 0 needs algorithm.recompute_old_logprobs=always: a replayed "
                          "sample's PPO ratio is taken against the old log-probs of the step that generated it")
