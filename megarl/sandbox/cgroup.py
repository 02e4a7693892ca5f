"""A memory cgroup per sandbox run or reward process, so that a limit holds for its processes together.

RLIMIT_AS bounds each process alone: a program that forks N children gets N times the limit. A
memory cgroup bounds the sum (files written to a tmpfs count too); the kernel kills inside the run
when it is exceeded. Runs get a cgroup below this process's own one, under cgroup v2 (controller
`memory` delegated to it) or v1 (the `memory` hierarchy); it needs write access there, which root
has in most containers and an ordinary user has only where it was delegated (systemd's `Delegate=`).
Where neither works, MemoryCgroups.find() says why and the sandbox caps the process count instead.

A run's cgroup may also bound its tasks (processes and threads, zombies until reaped: `pids.max`), where
the `pids` controller is there too: v2's in the same directory, v1's in a directory of the same name in
the `pids` hierarchy (`tasks_dir`). The kernel then refuses the fork or thread past it (EAGAIN) at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PREFIX = "megarl-sandbox-"


class MemoryCgroups:
    """Creates and removes the cgroups of runs below `parent` (a v1 or v2 cgroup directory); `tasks_parent`: where
    their task limits go (v2: `parent`; v1: this process's cgroup in the pids hierarchy), None where there is none,
    `tasks_where` saying which."""

    def __init__(self, parent: Path, version: int):
        self.parent, self.version = parent, version
        self.tasks_parent: Path | None = None  # set by find
        self.tasks_where = "no task limit"

    @classmethod
    def find(cls) -> tuple[MemoryCgroups | None, str]:
        """(the place to create run cgroups, where), or (None, why there is none)."""
        try:
            place = _own_cgroup("memory")
        except OSError as e:
            return None, f"cannot read this process's cgroups: {e}"
        if place is None:
            return None, "no cgroup memory controller is mounted"
        groups = cls(*place)
        try:
            if groups.version == 2:
                _enable(groups.parent, "memory")
            groups.remove(groups.create(f"probe-{os.getpid()}", 64 << 20))
        except OSError as e:
            return None, f"cannot create a memory cgroup under {groups.parent}: {e.strerror or e}"
        groups.tasks_parent, groups.tasks_where = groups._find_tasks_parent()
        return groups, f"cgroup v{groups.version} under {groups.parent}"

    def _find_tasks_parent(self) -> tuple[Path | None, str]:
        """(where task limits go, where), or (None, why there are none)."""
        try:
            place = self._tasks_place()
        except OSError as e:
            return None, f"no task limit: cannot read where the pids controller is: {e}"
        if place is None:
            return None, "no task limit: no pids controller for this process's cgroup"
        self.tasks_parent = place
        try:
            if self.version == 2:
                _enable(place, "pids")
            self.remove(self.create(f"probe-{os.getpid()}", 64 << 20, max_tasks=1))
        except OSError as e:
            self.tasks_parent = None
            return None, f"no task limit: cannot set pids.max under {place}: {e.strerror or e}"
        return place, f"task limits (pids.max) under {place}"

    def _tasks_place(self) -> Path | None:
        if self.version == 2:
            return self.parent if "pids" in (self.parent / "cgroup.controllers").read_text().split() else None
        found = _own_cgroup("pids", versions=(1,))
        return found[0] if found else None

    def create(self, name: str, limit_bytes: int, max_tasks: int = 0) -> Path:
        """The cgroup of a run: `limit_bytes` of memory and, where task limits can be set and `max_tasks` > 0, at
        most that many tasks. Processes join it with `join`."""
        path = self.parent / (PREFIX + name)
        path.mkdir()
        try:
            if self.version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                _write_if_present(path / "memory.swap.max", "0")  # no swapping past the limit
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                _write_if_present(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
            if max_tasks and (tasks := self.tasks_dir(path)):
                if tasks != path:
                    tasks.mkdir()
                (tasks / "pids.max").write_text(str(max_tasks))
        except OSError:
            self.remove(path)
            raise
        return path

    def tasks_dir(self, path: Path) -> Path | None:
        """Where the task limit of the run cgroup `path` is set (it may not be: `create` without max_tasks)."""
        if self.tasks_parent is None:
            return None
        return path if self.version == 2 else self.tasks_parent / path.name

    def join(self, path: Path, pid: int) -> None:
        """Move process `pid` (all its threads) into the run cgroup `path`, and into its task limit's where apart."""
        (path / "cgroup.procs").write_text(str(pid))
        if (tasks := self.tasks_dir(path)) and tasks != path and tasks.is_dir():
            (tasks / "cgroup.procs").write_text(str(pid))

    def remove(self, path: Path) -> None:
        """Remove a run's cgroup (and its task limit's directory where apart); its processes are gone, but a dying
        one can hold it for a moment."""
        tasks = self.tasks_dir(path)
        for directory in [path] + ([tasks] if tasks and tasks != path else []):
            _remove(directory)


def refused_tasks(path: Path | None) -> int:
    """Forks and thread starts the kernel refused in the cgroup `path` for its pids.max (its pids.events' `max`)."""
    return _event_count(path, ("pids.events",), "max")


def oom_kills(path: Path | None) -> int:
    """Processes the kernel killed in the memory cgroup `path` for passing its limit (v2's memory.events, v1's
    memory.oom_control: Linux 4.13+)."""
    return _event_count(path, ("memory.events", "memory.oom_control"), "oom_kill")


def _event_count(path: Path | None, files: tuple[str, ...], key: str) -> int:
    """The count on the `key` line of the first of a cgroup's event `files` that can be read; 0 if none."""
    for name in files if path is not None else ():
        try:
            lines = (path / name).read_text().splitlines()
        except OSError:
            continue
        return next((int(line.split()[1]) for line in lines if line.startswith(f"{key} ")), 0)
    return 0


def _remove(path: Path) -> None:
    # the kernel frees a cgroup once its last process is reaped: after a fork bomb on a loaded host, seconds
    deadline = time.monotonic() + 20.0
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _enable(parent: Path, controller: str) -> None:
    """Make v2's `controller` available to the cgroups below `parent`."""
    if controller not in (parent / "cgroup.subtree_control").read_text().split():
        # fails (EBUSY) where this cgroup holds processes itself: v2 allows no controller then
        (parent / "cgroup.subtree_control").write_text(f"+{controller}")


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)


def _own_cgroup(controller: str, versions: tuple[int, ...] = (1, 2)) -> tuple[Path, int] | None:
    """This process's cgroup directory in `controller`'s hierarchy: v1's, else v2's where the controller is
    available to it."""
    mounts = {}  # version -> (mount point, root of the hierarchy that the mount shows)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            mounts.setdefault(2, (fields[4], fields[3]))
        elif fstype == "cgroup" and controller in options:
            mounts.setdefault(1, (fields[4], fields[3]))
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            own[2] = path
        elif controller in controllers.split(","):
            own[1] = path
    for version in versions:
        if version in mounts and version in own:
            mount_point, mount_root = mounts[version]
            relative = os.path.relpath(own[version], mount_root)
            if relative.startswith(".."):  # our cgroup is outside what the mount shows
                continue
            directory = Path(os.path.normpath(Path(mount_point) / relative))
            if version == 1 or controller in (directory / "cgroup.controllers").read_text().split():
                return directory, version
    return None
