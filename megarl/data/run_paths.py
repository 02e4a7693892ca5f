"""Every path a run's config names, checked in milliseconds before Ray and the workers start (a missing file found
by a worker is a traceback half a minute later): one line per problem, each naming its key. Reading the files is
left to the dry run (megarl/data/inputs.py); this only asks whether they are there and readable, and whether the
directories a run writes can be made. `path_problems` is the RL run's (python -m megarl.train), `rm_path_problems`
the reward model's (python -m megarl.train_rm)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from megarl.data.files import SUFFIXES


RESUME_MODES = ("auto", "force", "none")  # trainer.resume's values that name no path


def path_problems(cfg) -> list[str]:
    """'key=value: what is wrong' for each input that is not there and each output directory that cannot be made."""
    problems = []
    for key, path in (("data.task", cfg.data.task), ("data.val_task", cfg.data.val_task)):
        if path.endswith(SUFFIXES) and (problem := unreadable_file(path)):
            problems.append(f"{key}={path}: {'no such prompt file' if problem == NO_FILE else problem}")
    problems += file_problems([("sft.data", cfg.sft.data)])
    problems += model_problems([("model.path", cfg.model.path if cfg.model.path != "tiny" else ""),
                                # only GAE has a critic
                                ("critic.path", cfg.critic.path if cfg.algorithm.advantage == "gae" else ""),
                                ("reward_model.path", cfg.reward_model.path)])
    if cfg.rollout.replay_dir and not Path(cfg.rollout.replay_dir).is_dir():
        problems.append(f"rollout.replay_dir={cfg.rollout.replay_dir}: no such directory")
    if cfg.trainer.resume not in RESUME_MODES and not os.path.exists(cfg.trainer.resume):
        problems.append(f"trainer.resume={cfg.trainer.resume}: no such checkpoint (or directory of checkpoints)")
    return problems + output_problems([("trainer.output_dir", cfg.trainer.output_dir),
                                       ("trainer.checkpoint_dir", cfg.trainer.checkpoint_dir),
                                       ("rollout.dump_dir", cfg.rollout.dump_dir)])


def rm_path_problems(cfg) -> list[str]:
    """The same for reward-model training: the preference files (a built-in task names none), the model it starts
    from, and where it writes (reward_model.path is its output here, the exported model)."""
    from megarl.data.tasks import TASKS  # here: it imports torch, which `python -m megarl.train --help` does not need

    train = cfg.preference.train if cfg.preference.train not in TASKS else ""
    return (file_problems([("preference.train", train), ("preference.val", cfg.preference.val)])
            + model_problems([("model.path", cfg.model.path if cfg.model.path != "tiny" else "")])
            + output_problems([("trainer.output_dir", cfg.trainer.output_dir),
                               ("trainer.checkpoint_dir", cfg.trainer.checkpoint_dir),
                               ("reward_model.path", cfg.reward_model.path)]))


NO_FILE = "no such file"


def unreadable_file(path: str) -> str | None:
    """Why the file `path` cannot be read (not there, a directory, closed to this user), or None."""
    if not os.path.exists(path):
        return NO_FILE
    if os.path.isdir(path):
        return "a directory, not a file"
    if not os.access(path, os.R_OK):
        return "not readable by this user"
    return None


def file_problems(keyed: list[tuple[str, str]]) -> list[str]:
    """'key=path: problem' for each input file (an empty path: none named) that cannot be read."""
    return [f"{key}={path}: {problem}" for key, path in keyed if path and (problem := unreadable_file(path))]


def model_problems(keyed: list[tuple[str, str]]) -> list[str]:
    """'key=path: problem' for each HF model directory (an empty path: none named) without a readable config.json."""
    problems = []
    for key, path in keyed:
        if path and not Path(path).is_dir():
            problems.append(f"{key}={path}: {missing_model(path)}")
        elif path and (problem := unreadable_file(str(Path(path) / "config.json"))):
            problems.append(f"{key}={path}: " + ("no config.json there (a HF model directory has one)"
                                                 if problem == NO_FILE else f"its config.json is {problem}"))
    return problems


# owner/name, as the Hugging Face hub names a model; a path that starts with . / or ~ never reads as one
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def missing_model(path: str) -> str:
    """Why a model directory that is not there cannot be used: one named like a hub id says how to fetch it (a run
    reads local directories only, and GPU nodes are often offline)."""
    if HUB_ID.fullmatch(path):
        return (f"no such local directory ('{path}' reads as a Hugging Face hub id, and megarl does not download "
                f"models: fetch it first with huggingface-cli download {path} --local-dir <dir>, then name <dir>)")
    return "no such model directory"


def output_problems(keyed: list[tuple[str, str]]) -> list[str]:
    """'key=path: problem' for each directory a run writes (an empty path: none named) that cannot be made."""
    return [f"{key}={path}: {problem}" for key, path in keyed if path and (problem := unwritable(path))]


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
