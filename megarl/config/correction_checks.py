"""The checks of the KL estimator, the single-sample-group trap and algorithm.rollout_correction; each
raises a ConfigError that names the key. Called from ConfigChecks.validate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config.validation import ConfigError

if TYPE_CHECKING:
    from megarl.config.sections import Config

# megarl/algorithms/kl.py maps verl's names (kl, mse, low_var_kl) to Schulman's; each may end with '+'
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl")
# estimators whose baseline is the sample's group (the other responses to its prompt): a group of one sample
# is its own baseline and gets advantage 0
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "opo", "grpo_passk",
                    "optimal_token_baseline")


def check_kl_and_groups(cfg: "Config") -> None:
    a = cfg.algorithm
    if a.kl_estimator.removesuffix("+") not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator={a.kl_estimator!r}: must be one of {', '.join(KL_ESTIMATORS)}, "
                          "each optionally with a trailing '+' (straight-through k2 gradient)")
    if cfg.rollout.n_samples == 1 and a.advantage in GROUP_ESTIMATORS and not a.allow_single_sample_groups:
        raise ConfigError(f"rollout.n_samples=1 with algorithm.advantage={a.advantage}: each prompt's group has one "
                          "sample, which is its own baseline, so every advantage is 0 and nothing is learned; use "
                          "rollout.n_samples >= 2 (or set algorithm.allow_single_sample_groups=true)")


def check_rollout_correction(cfg: "Config") -> None:
    a = cfg.algorithm
    rc = a.rollout_correction
    key = "algorithm.rollout_correction."
    for upper, lower in (("rollout_is_threshold", "rollout_is_threshold_lower"),
                         ("rollout_rs_threshold", "rollout_rs_threshold_lower")):
        hi, lo = getattr(rc, upper), getattr(rc, lower)
        if lo > hi:
            raise ConfigError(f"{key}{lower}={lo}: must be in [0, {key}{upper}={hi}] (0 = 1 / {upper})")
    if rc.rollout_is_threshold_lower and rc.rollout_is_mode != "mask":
        raise ConfigError(f"{key}rollout_is_threshold_lower={rc.rollout_is_threshold_lower} bounds the weights of "
                          f"{key}rollout_is_mode=mask only (truncate caps them from above)")
    if rc.rollout_is_batch_normalize and rc.rollout_is == "none":
        raise ConfigError(f"{key}rollout_is_batch_normalize=true needs {key}rollout_is (token or sequence)")
    others = [name for name, on in (("algorithm.tis=true", a.tis), (f"{key}rollout_is={rc.rollout_is}",
                                                                   rc.rollout_is != "none"),
                                    (f"{key}bypass_mode=true", rc.bypass_mode)) if on]
    if rc.decoupled and others:
        raise ConfigError(f"{key}decoupled=true with {others[0]}: the decoupled objective's weight is pi_old / "
                          "pi_rollout, which that already applies (or, in bypass mode, there is no proximal policy)")
    if a.tis and rc.rollout_is != "none":
        raise ConfigError(f"algorithm.tis=true with {key}rollout_is={rc.rollout_is}: both weight the loss by "
                          "pi_old / pi_rollout; keep one")
    _check_where_old_logprobs_come_from(cfg)


def _check_where_old_logprobs_come_from(cfg: "Config") -> None:
    a = cfg.algorithm
    rc = a.rollout_correction
    key = "algorithm.rollout_correction."
    if rc.bypass_mode:
        if a.recompute_old_logprobs == "always":
            raise ConfigError(f"{key}bypass_mode=true takes the rollout's log-probs as the old ones: "
                              "algorithm.recompute_old_logprobs=always contradicts it")
        if rc.rollout_is != "none" and a.policy_loss != "reinforce":
            raise ConfigError(f"{key}bypass_mode=true with {key}rollout_is={rc.rollout_is} and algorithm.policy_loss="
                              f"{a.policy_loss}: the ratio loss's ratio pi / pi_rollout already is the importance "
                              f"weight (verl's bypass ppo_clip); set {key}rollout_is=none, or "
                              "algorithm.policy_loss=reinforce for REINFORCE with importance weights")
        if rc.rollout_is_batch_normalize:
            raise ConfigError(f"{key}rollout_is_batch_normalize=true needs the batch's weights before the update; in "
                              "bypass mode they are computed in the loss, micro-batch by micro-batch")
    elif (rc.rollout_is != "none" or rc.rollout_rs != "none") and a.recompute_old_logprobs == "never":
        raise ConfigError(f"{key}rollout_is / rollout_rs are computed on the whole batch before training, from the "
                          "old log-probs: algorithm.recompute_old_logprobs=never cannot give them (use auto)")
