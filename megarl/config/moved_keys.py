"""megarl's own keys that moved: each former dotted key and the key it is now.

A command that gives a former key (in a recipe or on the command line) sets the new one, and the run says so once,
naming both (megarl/config/verl.py's `plan`, beside verl's keys); one source giving both names different values is
an error that names both. A checkpoint's stored settings under former names are compared under the new ones
(megarl/config/fingerprint.py). The former names are read for one release after the move, then dropped.
"""

from __future__ import annotations

A = "algorithm"

MOVED_KEYS = {
    # each loss's and estimator's own knobs, nested under it (megarl/config/knob_sections.py)
    f"{A}.clip_ratio_c": f"{A}.dual_clip.clip_ratio_c",
    f"{A}.gspo_clip_eps": f"{A}.gspo.clip_eps",
    f"{A}.gspo_clip_eps_high": f"{A}.gspo.clip_eps_high",
    f"{A}.gmpo_clip_eps": f"{A}.gmpo.clip_eps",
    f"{A}.cispo_clip_eps_low": f"{A}.cispo.clip_eps_low",
    f"{A}.cispo_clip_eps_high": f"{A}.cispo.clip_eps_high",
    f"{A}.sapo_tau_pos": f"{A}.sapo.tau_pos",
    f"{A}.sapo_tau_neg": f"{A}.sapo.tau_neg",
    f"{A}.clip_cov_ratio": f"{A}.clip_cov.ratio",
    f"{A}.clip_cov_lb": f"{A}.clip_cov.lb",
    f"{A}.clip_cov_ub": f"{A}.clip_cov.ub",
    f"{A}.kl_cov_ratio": f"{A}.kl_cov.ratio",
    f"{A}.kl_cov_coef": f"{A}.kl_cov.coef",
    f"{A}.gpg_norm_by_std": f"{A}.gpg.norm_by_std",
    f"{A}.otb_zero_tail": f"{A}.otb.zero_tail",
    f"{A}.critic_lam": f"{A}.gae.critic_lam",
    f"{A}.lam_length_alpha": f"{A}.gae.lam_length_alpha",
    f"{A}.critic_warmup_steps": f"{A}.gae.critic_warmup_steps",
    # features beside the loss
    f"{A}.positive_lm_coef": f"{A}.positive_lm.coef",
    f"{A}.positive_lm_threshold": f"{A}.positive_lm.threshold",
    f"{A}.overlong_buffer_len": f"{A}.overlong_buffer.len",
    f"{A}.overlong_penalty_factor": f"{A}.overlong_buffer.penalty_factor",
    # the switch is now a section's key: `algorithm.pf_ppo=pow` (a value, not a mapping) still sets it
    f"{A}.pf_ppo": f"{A}.pf_ppo.method",
    f"{A}.pf_ppo_weight_pow": f"{A}.pf_ppo.weight_pow",
    f"{A}.pf_ppo_scope": f"{A}.pf_ppo.scope",
    f"{A}.pf_ppo_resample": f"{A}.pf_ppo.resample",
    f"{A}.pf_ppo_replay": f"{A}.pf_ppo.replay",
}


def moved_to(key: str, value) -> str | None:
    """The key a former `key` set to `value` is now, or None. A former key that names a section now
    (algorithm.pf_ppo) is the former key only with a value that is not a mapping of the section's keys."""
    new = MOVED_KEYS.get(key)
    return None if new is None or isinstance(value, dict) else new


def moved_note(old: str, new: str) -> str:
    """What the run says, once, of a former key it read."""
    return f"{old} is now {new} (the former name is read for one more release)"


def current_names(values: dict) -> dict:
    """{key: value} with every former key under its new name (a checkpoint's stored settings)."""
    return {MOVED_KEYS.get(key, key): value for key, value in values.items()}
