"""One live run per directory: `with RunLock([output_dir, checkpoint_dir]).acquire(): ...` holds `run.lock` in each
(acquire raises RunLockError naming the live owner; the with block releases, as with a file that `open` opened).

A lock is an flock(2) on the file, which records its owner (pid, host, start time, command) for the message that
refuses a second run. The kernel drops an flock when its process ends, however it ends (SIGKILL too), so a lock
whose owner died is free: the next run takes it over, noting the dead owner the file still names. A run that ends
normally empties the file.

Limits: flock excludes processes of one host. Across hosts it holds only where the file system passes locks on
(local disks do not span hosts; NFS does through its lock manager, some network file systems do not at all); where
it does not, two hosts' runs both get the lock, and the note of a takeover from another host is all that shows.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """Another live run holds the directory; the message names it."""


class RunLock:
    def __init__(self, directories: list[str | Path]):
        self.paths = list(dict.fromkeys(Path(d).resolve() / LOCK_FILE for d in directories))
        self.fds: list[int] = []

    def acquire(self) -> "RunLock":
        try:
            for path in self.paths:
                self.fds.append(_take(path))
        except BaseException:
            self.release()
            raise
        return self

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for fd in self.fds:
            os.ftruncate(fd, 0)  # emptied while still held: a later run finds no owner to take over from
            os.close(fd)  # closing drops the flock
        self.fds = []


def _take(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        raise RunLockError(
            f"{path.parent} is in use by another run: {_describe(owner)}. Two runs in one directory would overwrite "
            "each other's checkpoints and metrics: wait for that run to end (or stop it), or give this one its own "
            f"trainer.output_dir (and trainer.checkpoint_dir). Lock file: {path}") from None
    previous = _owner(fd)
    if previous is not None:
        print(f"note: {path}: taken over from {_describe(previous)}, which ended without releasing it "
              f"({_why_free(previous)})", flush=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(" ", "seconds"), "command": " ".join(sys.argv)[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def _owner(fd: int) -> dict | None:
    """The owner the lock file names; None for an empty file (no owner, or one that ended normally)."""
    text = os.pread(fd, 4096, 0)
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?", "command": f"unreadable record {text[:80]!r}"}


def _describe(owner: dict | None) -> str:
    if owner is None:
        return "a run that has not written its record yet"
    return f"pid {owner['pid']} on host {owner['host']}, started {owner['started']} ({owner['command']})"


def _why_free(owner: dict) -> str:
    if owner["host"] != socket.gethostname():
        return ("it ran on another host, whose processes this one cannot see: if it still runs, stop this run, as the "
                "file system did not pass its lock on")
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return f"pid {owner['pid']} is gone"
    except (ValueError, PermissionError):  # an unreadable record; a pid now another user's process
        pass
    return "its lock was free"
