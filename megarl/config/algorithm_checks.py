"""The checks of the VAPO and PF-PPO options and of the further estimators' and losses' knobs;
each raises a ConfigError that names the key. Called from ConfigChecks.validate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config.validation import ConfigError

if TYPE_CHECKING:
    from megarl.config.sections import Config


def check_algorithm_extras(cfg: "Config") -> None:
    a = cfg.algorithm
    _check_vapo(cfg)
    _check_pf_ppo(cfg)
    if a.clip_cov.lb >= a.clip_cov.ub:
        raise ConfigError(f"algorithm.clip_cov.lb={a.clip_cov.lb} must be below algorithm.clip_cov.ub={a.clip_cov.ub}")
    if a.advantage == "optimal_token_baseline" and a.recompute_old_logprobs != "always":
        raise ConfigError("algorithm.advantage=optimal_token_baseline needs algorithm.recompute_old_logprobs=always: "
                          "the forward pass of the old log-probs also gives its sum over the vocabulary of p^2")
    if a.advantage == "grpo_passk" and cfg.rollout.n_samples < 2:
        raise ConfigError(f"algorithm.advantage=grpo_passk needs rollout.n_samples >= 2 (the best response's "
                          f"advantage is its lead over the second best); got {cfg.rollout.n_samples}")


def _check_vapo(cfg: "Config") -> None:
    a = cfg.algorithm
    if a.advantage != "gae":
        for key, value, off in (("algorithm.gae.critic_warmup_steps", a.gae.critic_warmup_steps, 0),
                                ("algorithm.gae.lam_length_alpha", a.gae.lam_length_alpha, 0),
                                ("algorithm.gae.critic_lam", a.gae.critic_lam, -1)):
            if value != off:
                raise ConfigError(f"{key}={value} needs a critic (algorithm.advantage=gae), not "
                                  f"algorithm.advantage={a.advantage}")


def _check_pf_ppo(cfg: "Config") -> None:
    a, p = cfg.algorithm, cfg.algorithm.pf_ppo
    if p.replay and (p.method == "none" or not p.resample):
        raise ConfigError("algorithm.pf_ppo.replay > 0 needs algorithm.pf_ppo.method set and "
                          "algorithm.pf_ppo.resample=true (replayed samples are drawn beside the step's)")
    if p.replay and a.recompute_old_logprobs != "always":
        raise ConfigError("algorithm.pf_ppo.replay > 0 needs algorithm.recompute_old_logprobs=always: a replayed "
                          "sample's PPO ratio is taken against the old log-probs of the step that generated it")
