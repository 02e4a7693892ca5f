"""What a reward process (pool.py) may hold, how it is measured, and ending it with everything it started.

A reward process lives for many calls, so a reward that keeps memory, threads or processes between calls grows it
without bound (a reward keeping 8 MiB a call reaches gigabytes within a few steps), and a process it
daemonises (a double fork, with setsid or not) outlives a kill of the worker's process group. So:

- memory (reward.worker_memory_mb): the pool sums the resident memory of the process and its descendants while a
  call runs and after it (RSS: pages shared after a fork count in each process, an overestimate). Where this process
  may create memory cgroups (megarl/sandbox/cgroup.py: root in most containers, or a cgroup delegated to the user)
  each reward process and all it starts also share one of that size, which the kernel enforces (it kills inside the
  group); elsewhere each process gets RLIMIT_AS of ADDRESS_SPACE_FACTOR times it, a backstop against one allocation
  too fast to measure (an allocation past it raises MemoryError): an interpreter reserves far more address space
  than it touches (Python alone ~110 MiB for ~30 MiB resident; torch's libraries gigabytes), and thread stacks
  reserve it too, so the cap also bounds a process's threads.
- threads (reward.worker_max_threads): of the process and its descendants together, measured as memory is. Where
  the process has a cgroup of its own with the pids controller (v2's, or v1's pids hierarchy: sandbox/cgroup.py),
  that cgroup's pids.max is the same number, so the kernel refuses the fork or thread start past it at once (EAGAIN
  inside the reward) and the call fails, named, as a measured breach does; a fork bomb never outgrows it. Elsewhere
  only the measurement bounds them: a fork or thread bomb is stopped at the next one (within pool.py's
  WATCH_INTERVAL_S), not at its first thread. Not RLIMIT_NPROC: it counts every process of the user (the driver's,
  Ray's, another run's), so a limit tight enough to bound a reward fails other forks as the host gets busier, and
  root is exempt from it.
- a call during which a limit is passed fails, named (RewardLimitError: the reward, the limit, the key that raises
  it); its process is replaced. A process that has run reward.worker_max_calls calls, or holds more than
  RECYCLE_FRACTION of its memory after a call, is replaced before its next one (a leak then costs no sample).
- ending a reward process works for any user: the worker makes itself a child subreaper (PR_SET_CHILD_SUBREAPER),
  so a process orphaned below it (a double fork) is reparented to it instead of to init (and, once exited, stays a
  zombie there, counted as a thread: reaping it could take the exit status of one of the reward's own children
  instead); `end_worker` stops it (SIGSTOP: a stopped subreaper still adopts orphans), kills what is below it until
  nothing lives there, with its cgroup's processes where it has one, then kills it. Without a cgroup, a worker that
  dies on its own (a segfault) first has its descendants reparented to init: those still in its process group are
  killed by the group, daemonised ones end with the run (its lease: megarl/workers/lease.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from megarl.rewards.scoring import RewardCallError
from megarl.utils.processes import group_members, kill_until_gone

logger = logging.getLogger(__name__)

RECYCLE_FRACTION = 0.75
ADDRESS_SPACE_FACTOR = 2
KILL_WAIT_S = 10.0  # a process in uninterruptible sleep (a hung file system) may not die sooner
PAGE = os.sysconf("SC_PAGE_SIZE")
PR_SET_CHILD_SUBREAPER = 36
# the kernel lists each thread's children in /proc/<pid>/task/<tid>/children where built with CONFIG_PROC_CHILDREN;
# elsewhere the process table is read whole
CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class RewardLimitError(RewardCallError):
    """A reward call passed its reward process's memory or thread limit."""


@dataclass(frozen=True)
class WorkerLimits:
    memory_mb: int
    max_threads: int
    max_calls: int  # 0: no limit

    @classmethod
    def from_config(cls, reward_cfg) -> "WorkerLimits":
        return cls(reward_cfg.worker_memory_mb, reward_cfg.worker_max_threads, reward_cfg.worker_max_calls)

    def memory_breach(self, name: str, held: str) -> RewardLimitError:
        return RewardLimitError(f"reward {name!r} passed its memory limit: {held}, over reward.worker_memory_mb="
                                f"{self.memory_mb} (raise it if the reward needs more; one that keeps memory between "
                                "calls leaks)")

    def thread_breach(self, name: str, threads: int) -> RewardLimitError:
        return RewardLimitError(f"reward {name!r} passed its thread limit: its reward process and the processes it "
                                f"started ran {threads} threads, over reward.worker_max_threads={self.max_threads} "
                                "(raise it if the reward needs more; one that leaves threads or processes running "
                                "leaks)")

    def thread_refusal(self, name: str) -> RewardLimitError:
        return RewardLimitError(f"reward {name!r} passed its thread limit: its reward process and the processes it "
                                f"started tried to run more threads than reward.worker_max_threads={self.max_threads} "
                                "(the kernel refused a fork or thread start past its cgroup's pids.max; raise it if "
                                "the reward needs more; one that leaves threads or processes running leaks)")


class Usage(NamedTuple):
    rss_bytes: int
    threads: int  # a process counts one at least (a zombie holds a pid until it is reaped)


class _Process(NamedTuple):
    parent: int
    zombie: bool
    threads: int
    rss_bytes: int


def become_subreaper() -> None:
    """Orphans below this process are reparented to it, not to init (Linux 3.4+)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _read(pid: int) -> _Process | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold anything
    except (OSError, IndexError):  # gone meanwhile
        return None
    return _Process(int(fields[1]), fields[0] in (b"Z", b"X"), int(fields[17]), int(fields[21]) * PAGE)


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += map(int, f.read().split())
        except OSError:  # the thread ended meanwhile
            pass
    return found


def tree(root: int) -> dict[int, _Process]:
    """`root` and every process below it, zombies included."""
    if CHILDREN_FILES:
        found, following = {}, [root]
        while following:
            pid = following.pop()
            process = _read(pid)
            if process is not None and pid not in found:
                found[pid] = process
                following += _children(pid)
        return found
    table = {int(name): p for name in os.listdir("/proc") if name.isdigit() and (p := _read(int(name))) is not None}
    found, grew = ({root: table[root]} if root in table else {}), True
    while grew:
        grew = False
        for pid, process in table.items():
            if process.parent in found and pid not in found:
                found[pid] = process
                grew = True
    return found


def usage(root: int) -> Usage:
    """What `root` and every process below it hold."""
    processes = tree(root).values()
    return Usage(sum(p.rss_bytes for p in processes), sum(max(1, p.threads) for p in processes))


def kill_below(root: int | None, cgroup: Path | None = None) -> None:
    """SIGKILL every process below `root` (None: none), and in its cgroup, until none lives: a process killed
    meanwhile leaves its own children orphaned, which come to `root` while it is a subreaper."""
    def living() -> set[int]:
        found = {pid for pid, p in tree(root).items() if not p.zombie} if root else set()
        found |= {pid for pid in cgroup_processes(cgroup) if _alive(pid)}
        found.discard(root)
        return found

    if left := kill_until_gone(living, KILL_WAIT_S):
        logger.warning("reward process %s: processes %s did not end within %g s of SIGKILL (in uninterruptible "
                       "sleep?)", root, sorted(left), KILL_WAIT_S)


def kill_group(pgid: int) -> None:
    """SIGKILL the processes of group `pgid` (a reward process that died on its own: its children, orphaned to init,
    that did not leave its group) and see them gone."""
    if left := kill_until_gone(lambda: group_members(pgid), KILL_WAIT_S):
        logger.warning("processes %s of reward process group %d did not end within %g s of SIGKILL", sorted(left),
                       pgid, KILL_WAIT_S)


def _alive(pid: int) -> bool:
    process = _read(pid)
    return process is not None and not process.zombie


def end_worker(pid: int | None, cgroup: Path | None) -> None:
    """Kill a reward process (a subreaper) and everything below it, daemonised or not; the caller reaps it. `pid`
    None: it has exited and been reaped (its pid may be another process's now): what is in its cgroup, if any."""
    if pid is None:
        kill_below(None, cgroup)
        return
    try:
        os.kill(pid, signal.SIGSTOP)  # it neither runs the reward nor reaps while we kill below it
    except ProcessLookupError:
        pass
    try:
        kill_below(pid, cgroup)
    finally:  # a stopped worker left behind would never notice its driver's end
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cgroup_processes(path: Path | None) -> list[int]:
    """The processes in a cgroup (what a v1 or v2 cgroup.procs lists)."""
    if path is None:
        return []
    try:
        return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []
