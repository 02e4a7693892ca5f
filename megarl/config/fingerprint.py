"""What a run is: the config keys that change what its steps compute, their values and a hash of them.

Every checkpoint stores them (megarl/engine/checkpoint_dir.py); a resume compares them with the resuming run's
(megarl/resume.py), so a run restarted in the same directory with other settings is refused by name instead of
silently continuing the old run under new numbers. A checkpoint stores every training key; the comparison leaves out
those that neither run reads (`unread_keys`: a critic's settings where no critic is trained, the knobs of losses and
estimators not selected), so a changed default of a setting a run never used does not refuse its checkpoint. A key
stored under a name megarl has since moved (megarl/config/moved_keys.py) is compared under its new name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from megarl.config.moved_keys import current_names
from megarl.config.sections import Config

_ROLES = ("actor", "critic", "reward_model")

# Keys (or whole groups, by prefix) that say where a run writes and logs, how its processes are placed, checked and
# timed out, or how far it goes: none changes what a step computes, so a checkpoint resumes under other values of
# them. Everything else is part of the run.
NOT_TRAINING = {
    "trainer.output_dir": "where the run writes",
    "trainer.checkpoint_dir": "where checkpoints go",
    "trainer.resume": "which checkpoint the run starts from",
    "trainer.steps": "how far the run goes: a finished run may be continued further",
    "trainer.eval_every": "when the held-out set is measured (an evaluation changes no weights and no random state "
                          "of training: its sampling seed is fixed)",
    "trainer.save_every": "when checkpoints are written",
    "trainer.keep_last": "how many checkpoints are kept",
    "trainer.verify_checkpoint": "how closely a checkpoint is checked before a resume",
    "trainer.verify_weight_sync_every": "how often the rollout engine's weights are checked (a check changes none)",
    "trainer.verify_weight_sync_deep": "how the rollout engine's weights are checked",
    "trainer.loggers": "where metrics go",
    "trainer.project_name": "the name trackers file the run under",
    "trainer.experiment_name": "the name trackers file the run under",
    "trainer.profile_update": "which update runs under the profiler",
    "trainer.worker_timeout_s": "how long a call may take before the run is stopped",
    "trainer.max_restarts": "how many lost processes a run replaces before it stops (a replay computes the same steps)",
    "trainer.ray_address": "which Ray cluster runs the processes",
    "trainer.placement": "how training ranks spread over Ray nodes",
    "trainer.cpus_per_rank": "Ray CPUs reserved per rank",
    "trainer.threads_per_rank": "torch threads per rank (CPU)",
    "trainer.worker_env": "environment of the training processes (logging, scheduling priority)",
    "trainer.sync_bucket_mb": "how the weights are chunked on their way to the rollout engine (delivered bit for bit)",
    "trainer.offload_between_phases": "where idle weights wait between phases (memory, not values)",
    "rollout.num_cpus": "Ray CPUs of the rollout actor",
    "rollout.sglang_mem_fraction": "SGLang's share of GPU memory",
    "rollout.dump_dir": "where each step's samples are written",
    "reward.num_workers": "how many processes score (each sample gets the same reward)",
    # dist checkpointing reshards a checkpoint to any layout (megarl/engine/checkpoint.py): the same updates to float
    # rounding; the losses normalise over the whole mini-batch, so micro-batching and recompute change no update
    **{f"{role}.parallel": "training layout: a checkpoint loads at any layout" for role in _ROLES},
    **{f"{role}.{key}": "memory and speed: the same updates to float rounding" for role in _ROLES
       for key in ("micro_batch_size", "max_tokens_per_micro_batch", "recompute", "recompute_modules")},
}


# Each advantage estimator's and policy loss's own knobs (algorithm.<knob>, or algorithm.<section> for all of a
# section's, as megarl/algorithms/advantages.py, losses.py and loss_variants.py read them): a run reads those of the
# estimator and loss it selects. A name not listed (a plugin, `package.module:function`) may read any of them: all are
# compared for it.
ESTIMATOR_KNOBS = {
    "grpo": ("norm_adv_by_std",), "grpo_passk": ("norm_adv_by_std",), "rloo": (), "opo": (), "remax": (),
    "gpg": ("gpg",), "optimal_token_baseline": ("otb",),
    "reinforce_plus_plus": ("gamma",), "reinforce_plus_plus_baseline": ("gamma",),
    "gae": ("gamma", "lam", "gae"),
}
LOSS_KNOBS = {
    "ppo_clip": ("clip_eps", "clip_eps_high"), "dual_clip": ("clip_eps", "clip_eps_high", "dual_clip"),
    "clip_cov": ("clip_eps", "clip_eps_high", "clip_cov"), "kl_cov": ("kl_cov",), "gspo": ("gspo",),
    "gmpo": ("gmpo",), "cispo": ("cispo",), "sapo": ("sapo",), "reinforce": (), "gpg": (),
}


def is_training_key(key: str) -> bool:
    return not any(key == k or key.startswith(k + ".") for k in NOT_TRAINING)


def _within(key: str, prefixes: set[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def unread_keys(values: dict) -> set[str]:
    """The keys (or sections, by prefix) that a run of these training settings never reads."""
    def knobs(table: dict, chosen: str) -> set[str]:
        if chosen not in table:
            return set()
        return {f"algorithm.{k}" for ks in table.values() for k in ks} - {f"algorithm.{k}" for k in table[chosen]}

    unread = knobs(ESTIMATOR_KNOBS, values["algorithm.advantage"]) | knobs(LOSS_KNOBS, values["algorithm.policy_loss"])
    if values["algorithm.advantage"] != "gae":  # only gae trains a critic (megarl/trainer.py)
        unread.add("critic")
    if not values["reward_model.path"]:  # no reward model scores; its section is train_rm's
        unread.add("reward_model")
    if values["algorithm.loss_agg"] != "seq-mean-token-sum-norm":
        unread.add("algorithm.loss_agg_norm_len")
    if values["trainer.mode"] == "sync":
        unread.add("async")
    if not values["agent.enabled"]:  # no agent loop; its observation_template renders SFT warm-start traces too
        unread |= {k for k in values
                   if k.startswith("agent.") and k not in ("agent.enabled", "agent.observation_template")}
    return unread | {"preference"}  # train_rm's pairs: an RL run reads none


def _options(obj, prefix: str = "") -> dict:
    """{dotted key: value} of every option (a dict-valued option, e.g. trainer.worker_env, is one value)."""
    out = {}
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name.rstrip("_")  # async_ is `async` in recipes
        if dataclasses.is_dataclass(value):
            out |= _options(value, key + ".")
        else:
            out[key] = json.loads(json.dumps(value))  # as checkpoint.json gives it back (tuples as lists)
    return out


def fingerprint(cfg: Config) -> dict:
    """{"sha256": hash of the training keys' values, "values": {key: value}}: stored in each checkpoint."""
    values = {k: v for k, v in sorted(_options(cfg).items()) if is_training_key(k)}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "values": values}


def differences(saved: dict, current: dict) -> list[str]:
    """The training keys whose values differ, as `key: old -> new`, of those that either run reads (unread_keys). A
    key the saved run did not know (added to megarl since) counts as its default there; a key megarl no longer has
    cannot be set, so it is not named; a key stored under a former name is compared under its new one."""
    if saved["sha256"] == current["sha256"]:
        return []
    new = current["values"]
    stored = current_names(saved["values"])
    old = {key: stored.get(key, default) for key, default in _options(Config()).items()}
    unread = unread_keys(old) & unread_keys(new)  # a prefix both leave unread (a key read by one run is compared)
    return [f"{key}: {_show(old[key])} -> {_show(value)}"
            for key, value in new.items() if old.get(key) != value and not _within(key, unread)]


def _show(value) -> str:
    return json.dumps(value)
