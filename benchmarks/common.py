"""What the GRPO benchmarks of one workload share (benchmarks/e2e_vs_trl.py, e2e_vs_verl.py, async_grpo.py): the
workload's arguments, the check of a step's batch against them, what every run does first, running one side under a
deadline, and the environment a report records."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil

from megarl.utils.provenance import source_commit

ROOT = Path(__file__).resolve().parents[1]


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


def run_process(cmd: list[str], log: Path, timeout: float, env: dict, leftovers: str = "",
                server_logs: Path | None = None) -> dict:
    """Run `cmd` in its own session with output to `log`. Past `timeout`: SIGINT (the driver's finally blocks
    shut Ray and the engines down), then SIGKILL of the whole process group after 30 s. Afterwards, SGLang
    servers whose command line holds `leftovers` (this run's model directory) are ended: they run in sessions
    of their own and outlive a killed driver; the tails of the SGLang logs in `server_logs` (the run's output
    directory) go beside `log`, as `<log>_sglang_<port>.log.tail`: a run that stalls says why there."""
    start = time.monotonic()
    status = "ok"
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        # SIGINT back to its default in the child: a shell's background job (`cmd &`, nohup) inherits it ignored,
        # and Python then installs no KeyboardInterrupt handler, so the SIGINT below would do nothing
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        finally:  # also when this script is interrupted: end the driver and what it left in its process group
            try:  # (Ray's processes)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if leftovers:
                end_sglang_servers(leftovers)
            for server_log in sorted(server_logs.glob("sglang_*.log")) if server_logs else ():
                tail = server_log.read_text(errors="replace").splitlines()[-80:]
                (log.parent / f"{log.stem}_{server_log.name}.tail").write_text("\n".join(tail) + "\n")
    if status == "ok" and proc.returncode != 0:
        status = "failed"
    return {"status": status, "returncode": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
            "log": log.name}


def end_sglang_servers(marker: str) -> list[int]:
    """SIGKILL the process group of each SGLang server whose command line contains `marker`."""
    ended = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            pid = int(proc.name)
            if "sglang.launch_server" in cmdline and marker in cmdline and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
                ended.append(pid)
        except (OSError, ValueError):
            continue
    return ended


def environment(device: str) -> dict:
    """What a report records of where it ran: the commit, the date, the GPU, Python and the packages' versions."""
    versions = {}
    for name in ("torch", "transformers", "tokenizers", "trl", "datasets", "accelerate", "sglang", "megatron-core",
                 "ray", "pyarrow"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpu = "cpu"
    if device == "cuda":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        gpu = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "cuda (unknown)"
    return {"commit": source_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": gpu,
            "python": sys.version.split()[0], "versions": versions}
