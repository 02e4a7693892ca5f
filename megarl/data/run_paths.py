"""Every path a run's config names, checked in milliseconds before Ray and the workers start (a missing file found
by a worker is a traceback half a minute later): one line per problem, each naming its key. Reading the files is
left to the dry run (megarl/data/inputs.py); this only asks whether they are there, and whether the directories a
run writes can be made."""

from __future__ import annotations

import os
from pathlib import Path

from megarl.data.files import SUFFIXES


def path_problems(cfg) -> list[str]:
    """'key=value: what is wrong' for each input that is not there and each output directory that cannot be made."""
    problems = []
    for key, path in (("data.task", cfg.data.task), ("data.val_task", cfg.data.val_task)):
        if path.endswith(SUFFIXES) and not Path(path).is_file():
            problems.append(f"{key}={path}: no such prompt file")
    if cfg.sft.data and not Path(cfg.sft.data).is_file():
        problems.append(f"sft.data={cfg.sft.data}: no such file")
    models = [("model.path", cfg.model.path if cfg.model.path != "tiny" else ""),
              ("critic.path", cfg.critic.path if cfg.algorithm.advantage == "gae" else ""),  # only GAE has a critic
              ("reward_model.path", cfg.reward_model.path)]
    for key, path in models:
        if path and not Path(path).is_dir():
            problems.append(f"{key}={path}: no such model directory")
        elif path and not (Path(path) / "config.json").is_file():
            problems.append(f"{key}={path}: no config.json there (a HF model directory has one)")
    if cfg.rollout.replay_dir and not Path(cfg.rollout.replay_dir).is_dir():
        problems.append(f"rollout.replay_dir={cfg.rollout.replay_dir}: no such directory")
    for key in ("trainer.output_dir", "trainer.checkpoint_dir", "rollout.dump_dir"):
        section, name = key.split(".")
        path = getattr(getattr(cfg, section), name)
        if path and (problem := unwritable(path)):
            problems.append(f"{key}={path}: {problem}")
    return problems


def unwritable(path: str) -> str | None:
    """Why the directory `path` cannot be made or written (a file in its place or above it, a directory this user
    cannot write to), or None."""
    target = Path(path).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory" if existing != target else "a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user" if existing != target else "not writable by this user"
    return None
