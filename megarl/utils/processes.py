"""Ending a set of processes for certain: SIGKILL is delivered asynchronously, so a process just sent it may still
run (and be seen, and hold its memory) for a while on a loaded host; and killing one process orphans its children,
which a second look finds elsewhere."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Iterable


def kill_until_gone(living: Callable[[], Iterable[int]], wait_s: float, poll_s: float = 0.002) -> set[int]:
    """SIGKILL every pid `living()` returns until it returns none or `wait_s` passes; what still lives then (a
    process in uninterruptible sleep, on a hung file system, may not die sooner)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = set(living())
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(poll_s)


def group_members(pgid: int) -> set[int]:
    """The living (not zombie) processes of process group `pgid`."""
    found = set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold anything
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            found.add(int(name))
    return found


def with_environment(name: str, value: str) -> list[int]:
    """The live processes whose environment holds name=value: what a process started with a marker variable left
    running, however it detached (a zombie shows no environment)."""
    entry, found = f"{name}={value}".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found
