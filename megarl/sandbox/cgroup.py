"""A memory cgroup per sandbox run, so that a limit holds for the run's processes together.

RLIMIT_AS bounds each process alone: a program that forks N children gets N times the limit. A
memory cgroup bounds the sum (files written to a tmpfs count too); the kernel kills inside the run
when it is exceeded. Runs get a cgroup below this process's own one, under cgroup v2 (controller
`memory` delegated to it) or v1 (the `memory` hierarchy); it needs write access there, which root
has in most containers and an ordinary user has only where it was delegated (systemd's `Delegate=`).
Where neither works, MemoryCgroups.find() says why and the sandbox caps the process count instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PREFIX = "megarl-sandbox-"


class MemoryCgroups:
    """Creates and removes the cgroups of runs below `parent` (a v1 or v2 cgroup directory)."""

    def __init__(self, parent: Path, version: int):
        self.parent, self.version = parent, version

    @classmethod
    def find(cls) -> tuple[MemoryCgroups | None, str]:
        """(the place to create run cgroups, where), or (None, why there is none)."""
        try:
            place = _own_memory_cgroup()
        except OSError as e:
            return None, f"cannot read this process's cgroups: {e}"
        if place is None:
            return None, "no cgroup memory controller is mounted"
        groups = cls(*place)
        try:
            if groups.version == 2 and "memory" not in (groups.parent / "cgroup.subtree_control").read_text().split():
                # fails (EBUSY) where this cgroup holds processes itself: v2 allows no controller then
                (groups.parent / "cgroup.subtree_control").write_text("+memory")
            probe = groups.create(f"probe-{os.getpid()}", 64 << 20)
            groups.remove(probe)
        except OSError as e:
            return None, f"cannot create a memory cgroup under {groups.parent}: {e.strerror or e}"
        return groups, f"cgroup v{groups.version} under {groups.parent}"

    def create(self, name: str, limit_bytes: int) -> Path:
        path = self.parent / (PREFIX + name)
        path.mkdir()
        try:
            if self.version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                _write_if_present(path / "memory.swap.max", "0")  # no swapping past the limit
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                _write_if_present(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError:
            path.rmdir()
            raise
        return path

    @staticmethod
    def remove(path: Path) -> None:
        """Remove a run's cgroup; its processes are gone, but a dying one can hold it for a moment."""
        deadline = time.monotonic() + 5.0
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


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)


def _own_memory_cgroup() -> tuple[Path, int] | None:
    """This process's cgroup directory in the memory hierarchy: v1's `memory` one, else v2's where the
    memory controller is available to it."""
    mounts = {}  # (fstype, v1 memory?) -> (mount point, root of the hierarchy that the mount shows)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            mounts.setdefault(2, (fields[4], fields[3]))
        elif fstype == "cgroup" and "memory" in options:
            mounts.setdefault(1, (fields[4], fields[3]))
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            own[2] = path
        elif "memory" in controllers.split(","):
            own[1] = path
    for version in (1, 2):
        if version in mounts and version in own:
            mount_point, mount_root = mounts[version]
            relative = os.path.relpath(own[version], mount_root)
            if relative.startswith(".."):  # our cgroup is outside what the mount shows
                continue
            directory = Path(os.path.normpath(Path(mount_point) / relative))
            if version == 1 or "memory" in (directory / "cgroup.controllers").read_text().split():
                return directory, version
    return None
