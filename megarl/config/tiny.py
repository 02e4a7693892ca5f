"""The built-in tiny CPU run: the small values of a run of the built-in tiny model on the built-in task.

megarl's defaults (sections.py) are those of a real GPU run; a run of the tiny model sets its small values
itself, as the CPU recipes in configs/ do. Tests and CPU benchmarks build their configs from `tiny_config`; a test
that runs `python -m megarl.train` without a recipe passes `TINY_ARGS`.
"""

from __future__ import annotations

from megarl.config.loading import load_config
from megarl.config.sections import Config

# every default a real run has and the tiny run does not, at the tiny run's value
TINY_RUN = {
    "model.path": "tiny",
    "rollout.engine": "hf",
    "rollout.max_new_tokens": 16,
    "data.task": "reverse",
    "data.prompts_per_step": 8,
    "data.val_size": 64,
    "data.chat_template": False,  # the tiny model's character tokenizer has no chat template
    "trainer.steps": 10,
    "trainer.eval_every": 5,
    "actor.optim.lr": 1e-5,
    "actor.optim.weight_decay": 0.0,
    "critic.optim.weight_decay": 0.0,
    "algorithm.lam": 0.95,
    "sft.lr": 1e-3,
}

# the same as `key=value` overrides of `python -m megarl.train` (a recipe given beside them would lose to them)
TINY_ARGS = [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in TINY_RUN.items()]


def tiny_config(overrides: list[str] = (), path=None) -> Config:
    """The tiny run's config: defaults <- TINY_RUN <- the recipe at `path` <- `key=value` overrides, validated."""
    return load_config(path, overrides, base=TINY_RUN)
