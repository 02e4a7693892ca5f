"""Third-party warnings that say nothing to a megarl user, filtered once in every process megarl starts.

An entry point (python -m megarl.train, megarl.train_rm, megarl.convert) calls `install(verbose)` before it imports
megatron or transformers: it sets MEGARL_VERBOSE, which every process the run starts inherits (reward workers and
subprocesses by their environment; Ray actors also by their runtime_env, for a cluster the driver joined: `env()`),
and megarl's package import (megarl/__init__.py) calls `apply()` there, before the worker imports megatron. A process
megarl did not start (a test, a user's script importing megarl) has no MEGARL_VERBOSE and keeps every warning.
`--verbose` shows them all. Each entry says why it is dropped; anything not listed here is shown.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

ENV = "MEGARL_VERBOSE"  # "0": filter the known warnings; "1" (--verbose) or unset: show everything
VERBOSE_HELP = ("show the third-party warnings a run filters as saying nothing to a megarl user (megarl/utils/quiet.py "
                "lists them and why), in every process of the run")

# (message pattern, matched from the message's start; category; why it says nothing to a megarl user)
KNOWN_WARNINGS = [
    (r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning,
     "megarl's engine is built to run without TransformerEngine and Apex (torch's kernels, megarl's own fused ones: "
     "actor.fused_kernels); megatron says so once per module it imports, in every rank"),
]

# warnings that are GPU advice, dropped in a process that trains on the CPU (TrainWorker on device=cpu): on a GPU
# they stay, and scripts/env.sh and megarl/runtime_env.yaml set what they ask for
GPU_ADVICE = [
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
     "CUDA_DEVICE_MAX_CONNECTIONS orders CUDA streams; a CPU run has none"),
]

# (logger name, message pattern searched in the line, why)
KNOWN_LOG_LINES = [
    ("transformers.tokenization_utils_base", r"will result in indexing errors",
     "megarl bounds every sequence it feeds a model itself: prompts against the model's positions "
     "(data.max_prompt_length, named by row), responses and tool turns by rollout.max_new_tokens and "
     "agent.max_response_tokens; transformers warns when a text (e.g. a long tool result) is merely tokenized past "
     "the tokenizer's model_max_length, about a model call megarl does not make with it"),
    ("ray._private.authentication.authentication_token_setup", r"Token authentication is enabled for this Ray cluster",
     "the local Ray cluster a run starts for itself listens on this host only; its token is Ray's default"),
]


def install(verbose: bool) -> None:
    """An entry point's first call: the filters in this process and, through MEGARL_VERBOSE, in every process it
    starts; verbose (--verbose, or MEGARL_VERBOSE=1 inherited from a verbose run that started this one): none."""
    os.environ[ENV] = "1" if verbose or os.environ.get(ENV) == "1" else "0"
    apply()


def env() -> dict[str, str]:
    """What a Ray actor's runtime_env carries to it (a joined cluster's workers do not inherit the driver's env)."""
    return {ENV: os.environ[ENV]} if ENV in os.environ else {}


def filtering() -> bool:
    return os.environ.get(ENV) == "0"


def apply() -> None:
    """The filters in this process, when MEGARL_VERBOSE=0. Also stops transformers' weight-loading bars in a process
    whose stdout is not a terminal (a Ray worker's: they arrive as lines of carriage returns)."""
    if not filtering():
        return
    for pattern, category, _ in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, pattern, _ in KNOWN_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropLines) and f.pattern.pattern == pattern for f in logger.filters):  # once
            logger.addFilter(DropLines(pattern))
    if not sys.stdout.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when transformers is imported


def filter_gpu_advice() -> None:
    """In a process that trains on the CPU: GPU_ADVICE dropped too (when filtering)."""
    if filtering():
        for pattern, category, _ in GPU_ADVICE:
            warnings.filterwarnings("ignore", message=pattern, category=category)


class DropLines(logging.Filter):
    """Drops a logger's records whose message contains `pattern`."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())
