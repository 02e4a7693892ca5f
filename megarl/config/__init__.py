"""Typed configuration: every option is a dataclass field with a default and a one-line help.

A run's config is built from the defaults (sections.py), then a YAML recipe, then dotted `key=value`
overrides from the command line. Unknown keys, ill-typed values and inconsistent layouts are errors
that name the key (and, for a typo, the closest valid key).

fields.py       `opt` and `section`: a field's default, help and allowed values (range or choices), and
                `check_ranges`, the check of every option against its field, first in `Config.validate`
sections.py     the typed sections and the root `Config` that holds them (algorithm_sections.py: the algorithm
                and rollout sections; knob_sections.py: each loss's, estimator's and feature's own knobs under
                algorithm)
moved_keys.py   megarl's former key names and the keys they moved to, still read (with a note) for one release
validation.py   `ConfigError` and `Config.validate`: the checks of one option against another
loading.py      `load_config` (defaults <- YAML <- overrides), `all_keys`, `help_text`
run_defaults.py the defaults resolved at validation: rollout.engine=auto by the device, trainer.steps=0 by the
                prompt file's rows
tiny.py         `tiny_config` and `TINY_ARGS`: the built-in tiny CPU run's small values over the defaults (a real
                GPU run's)
"""

from megarl.config.loading import all_keys, help_text, load_config
from megarl.config.sections import (ActorConfig, AgentConfig, AlgorithmConfig, Config, CriticConfig, DataConfig,
                                    EngineConfig, ModelConfig, OptimConfig, ParallelConfig, RewardConfig,
                                    RewardModelConfig, RolloutConfig, SFTConfig, TrainerConfig, opt, section)
from megarl.config.validation import ConfigError

__all__ = ["ActorConfig", "AgentConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
           "EngineConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RewardConfig", "RewardModelConfig",
           "RolloutConfig", "SFTConfig", "TrainerConfig", "all_keys", "help_text", "load_config", "opt", "section"]
