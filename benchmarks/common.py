"""What the GRPO benchmarks of one workload share (benchmarks/e2e_vs_trl.py, e2e_vs_verl.py, async_grpo.py): the
workload's arguments, the check of a step's batch against them, and what every run does first."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import psutil


def add_run_arguments(p: argparse.ArgumentParser, smoke: str, budget_s: float, out_dir_required: bool = True) -> None:
    """What start_run reads: where results and work go, the CPU smoke run (`smoke`: what it does), the deadline."""
    p.add_argument("--out-dir", required=out_dir_required, help="results JSON and logs go here")
    p.add_argument("--work-dir", default="", help="the model, prompt files and run directories (default OUT/work; "
                                                  "keep it outside a directory that is copied back)")
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--budget-s", type=float, default=budget_s, help="deadline for everything, from the start "
                                                                    "(stopping a process at its cap included)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload, as e2e_vs_trl.megarl_command gives it to megarl: a random model of a named shape, prompts and
    completions of exact lengths, GRPO groups, micro-batches, held-out prompts, colocated SGLang's memory."""
    p.add_argument("--model", default="qwen2.5-0.5b", help="shape: a name in configs/models or a config.json path")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of every prompt")
    p.add_argument("--completion-len", type=int, default=512, help="tokens of every completion (the cap where "
                                                                   "lengths are natural)")
    p.add_argument("--n-samples", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward (a side that packs "
                                                               "micro-batches: that many sequences' worth of tokens)")
    p.add_argument("--val-size", type=int, default=8, help="held-out prompts, megarl's scored before and after")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.35, help="SGLang's static memory share where it "
                                                                           "shares the GPUs with training")


def smoke_sizes(p: argparse.ArgumentParser, argv: list[str] | None, **own) -> None:
    """With --smoke: the workload's tiny sizes and the script's `own`, unless given explicitly."""
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**{"prompt_len": 8, "completion_len": 8, "n_samples": 4, "micro_batch": 4, "val_size": 2} | own)


def check_completions(args, *completions: int) -> None:
    """Each count of completions per step fills whole GRPO groups and whole micro-batches."""
    for c in completions:
        if c % args.n_samples or c % args.micro_batch:
            raise SystemExit(f"completions per step ({c}) must be a multiple of --n-samples ({args.n_samples}) "
                             f"and --micro-batch ({args.micro_batch})")


def start_run(args) -> tuple[float, Path, str, Path, Path]:
    """What every end-to-end benchmark does first: exit through run_process's finally on `timeout`'s SIGTERM, the
    deadline (--budget-s), the output and work directories, the device, where the model goes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # from the process's start, as the caller's `timeout` counts: the imports before this line take ~20 s on a GPU host
    deadline = time.monotonic() + args.budget_s - (time.time() - psutil.Process().create_time())
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    work = Path(args.work_dir).resolve() if args.work_dir else out / "work"
    return deadline, out, device, work, work / "model"
