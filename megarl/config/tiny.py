"""The built-in tiny CPU run: the small values of a run of the built-in tiny model on the built-in task.

megarl's defaults (sections.py) are those of a real GPU run; a run of the tiny model sets its small values
itself, as the CPU recipes in configs/ do. Tests and CPU benchmarks build their configs from `tiny_config`.
"""

from __future__ import annotations

from megarl.config.loading import load_config
from megarl.config.sections import Config

TINY_RUN = {
    "model.path": "tiny",
    "rollout.engine": "hf",
    "rollout.max_new_tokens": 16,
    "data.task": "reverse",
    "data.prompts_per_step": 8,
    "data.val_size": 64,
    "trainer.steps": 10,
    "trainer.eval_every": 5,
}


def tiny_config(overrides: list[str] = (), path=None) -> Config:
    """The tiny run's config: defaults <- TINY_RUN <- the recipe at `path` <- `key=value` overrides, validated."""
    return load_config(path, overrides, base=TINY_RUN)
