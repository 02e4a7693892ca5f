"""Helpers for the launch tests: run the repo's scripts, and find the processes and sockets they leave.

Processes are found by what they carry, never by name alone, so that other Ray or Slurm users on the
machine are neither counted nor touched: a Ray temp dir in the command line, or SLURM_JOB_ID in the
environment.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"

# A short, cheap run of the CPU recipe: TP=2 over two ranks, a two-step warm start, one RL step.
TINY_RUN = ["--config", "configs/quickstart.yaml", "trainer.steps=1", "trainer.eval_every=1", "sft.steps=2",
            "data.val_size=16", "algorithm.kl_coef=0"]
# Two ranks of 2 CPUs cannot share a node of 3 CPUs, so the placement group spreads them over two nodes
# and the rollout actor takes the CPU left on one of them.
SPREAD_RUN = ["trainer.cpus_per_rank=2", "rollout.num_cpus=1"]
NODE_CPUS = 3


def script_env(**extra) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    env.update(extra)
    return env


def processes_with(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] and any(text in part for part in p.info["cmdline"]) and p.pid != os.getpid():
            found.append(p)
    return found


def processes_of_slurm_job(job_id: str) -> list[psutil.Process]:
    """Live processes started inside a Slurm job (they inherit SLURM_JOB_ID)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("SLURM_JOB_ID") == job_id:
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def wait_until_gone(find, timeout: float) -> list[psutil.Process]:
    """Poll `find()` until it returns nothing or `timeout` passes; returns what is left."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in find() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def non_loopback_listeners(pids: set[int]) -> list[str]:
    """TCP sockets listening on anything but loopback, owned by one of `pids`."""
    bad = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            ip = c.laddr.ip.removeprefix("::ffff:")
            if ip not in ("127.0.0.1", "::1"):
                bad.append(f"{ip}:{c.laddr.port} ({psutil.Process(c.pid).name()})")
    return bad


def tree_pids(root: psutil.Process) -> set[int]:
    try:
        return {root.pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def stop_process_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to a process started with start_new_session=True, SIGKILL to its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
