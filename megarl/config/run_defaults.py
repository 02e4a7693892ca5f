"""The defaults that depend on the machine or on the data, resolved when a config is validated, so that everything
reading the config sees the value the run uses: rollout.engine=auto (sglang where training runs on a GPU, hf on the
CPU) and trainer.steps=0 (one pass over data.task's prompt file)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config.validation import ConfigError
from megarl.config.verl import count_rows
from megarl.data.files import SUFFIXES as PROMPT_FILES

if TYPE_CHECKING:
    from megarl.config.sections import Config


def training_device(device: str) -> str:
    """trainer.device as the run resolves it: auto is cuda where a GPU is visible, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def one_pass_steps(cfg: "Config") -> int:
    """RL steps of one pass over data.task's prompt file (rows // data.prompts_per_step, as verl's dataloader drops
    the last partial batch); 0 while data.task is unset or the file is not there (a --check-config away from the
    data: the run itself names the missing file before anything starts)."""
    task, batch = cfg.data.task, cfg.data.prompts_per_step
    if not task:  # python -m megarl.train names the missing data.task
        return 0
    if not task.endswith(PROMPT_FILES):
        raise ConfigError(f"trainer.steps=0: one pass over data.task's prompt file, and data.task={task!r} is a "
                          "built-in task with no end: set trainer.steps")
    rows = count_rows(task)
    if rows is None:
        return 0
    if rows < batch:
        raise ConfigError(f"trainer.steps=0: one pass over data.task={task} ({rows} rows), fewer than one "
                          f"step's data.prompts_per_step={batch}: set trainer.steps or a smaller "
                          "data.prompts_per_step")
    return rows // batch


def resolve_run_defaults(cfg: "Config") -> None:
    if cfg.rollout.engine == "auto":
        cfg.rollout.engine = "sglang" if training_device(cfg.trainer.device) == "cuda" else "hf"
    if cfg.trainer.steps == 0:
        cfg.trainer.steps = one_pass_steps(cfg)
