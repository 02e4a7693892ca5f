"""A run's lease on the processes it starts: when the driver ends, however it ends (SIGKILL too), every process it
started on its node ends with it, within a second.

`hold()` (the driver, before Ray starts: megarl/stops.py) starts a reaper, this file run by path (standard library
only: it starts in milliseconds), in a session of its own so that a Ctrl-C or a signal to the driver's process group
does not reach it, and puts the run's id in the driver's environment as MEGARL_RUN_ID, which every process started
from then on inherits. The reaper waits until the driver releases the lease (`release()`, at the end of a run) or
dies: it reads a pipe whose only writer is the driver, which the kernel closes when the driver dies, and watches its
parent as well, in case a forked child holds the pipe's end. Meanwhile it records, every half second, the processes
descending from the driver that started since the lease began. At the end it SIGKILLs those it recorded (by pid and
start time: never a reused pid), those whose environment holds the run's id, and everything below them: the local
Ray's GCS, raylet and agents, the training ranks, the rollout actor, megatron's checkpoint writers, the reward
processes, SGLang's guards, servers and schedulers.

Both, because each misses some: a killed driver's orphans are reparented to init at once, so a process started in
the last half second before a SIGKILL is found by its environment only; and a process that sets its title may
overwrite what /proc shows of its environment (Ray's agents do), or was started with an environment of its own (the
code sandbox's supervisor: it ends its run when its parent dies, megarl/sandbox/runner.py), so it is found by its
ancestry only.

What survived a SIGKILLed driver without it: Ray ends a local cluster's workers within a few seconds of the raylet,
which dies with the driver, but its dashboard and runtime-env agents wait ~60 s for the dead GCS before they exit.
Outside its reach: other nodes, and the actors of a joined cluster, which its raylets started (Ray ends a dead
driver's actors itself, within seconds; an SGLang server's guard then ends the server: megarl/rollout/server_guard.py).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

ENV = "MEGARL_RUN_ID"
SWEEP_S = 10.0  # the reaper gives up on processes that will not die (in the kernel, unkillable) after this


class _Lease:
    def __init__(self):
        self.run_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.previous = os.environ.get(ENV)
        read, self.write = os.pipe()  # both ends close-on-exec: no process the run starts inherits the write end
        env = {k: v for k, v in os.environ.items() if k != ENV}
        self.reaper = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), self.run_id,
                                        str(os.getpid()), str(read)], pass_fds=(read,), env=env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(read)
        os.environ[ENV] = self.run_id


_held: _Lease | None = None


def hold() -> str:
    """Mark the processes this driver starts from now on with a new run id, and start the reaper that ends them when
    the driver ends (a lease already held is released first). Returns the id."""
    global _held
    release()
    _held = _Lease()
    return _held.run_id


def release(wait: float = SWEEP_S + 5) -> None:
    """The run is over: the reaper ends what is left of it now (silently: it speaks only for a driver that died),
    waited for up to `wait` seconds; the environment is as before."""
    global _held
    lease, _held = _held, None
    if lease is None:
        return
    try:
        os.write(lease.write, b"r")  # read as a release even where a forked child keeps the pipe open
    finally:
        os.close(lease.write)
    if lease.previous is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = lease.previous
    try:
        lease.reaper.wait(wait)
    except subprocess.TimeoutExpired:
        pass


# ---- the reaper (run by path) ----------------------------------------------------------------------------------

def table() -> dict[int, tuple[int, int]]:
    """Every live process of this node (not the zombies: dead, waiting for their parent to read their status):
    pid -> (parent pid, start time in clock ticks since boot)."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold anything
                if fields[0] not in (b"Z", b"X"):
                    found[int(name)] = (int(fields[1]), int(fields[19]))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    return found


def marked(pids, run_id: str) -> set[int]:
    """Those of `pids` whose environment holds run_id (a process that set its title, e.g. Ray's agents, may have
    overwritten part of what /proc shows of it; other users' processes cannot be read)."""
    entry, found = f"{ENV}={run_id}".encode(), set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            pass
    return found


def below(roots: set[int], processes: dict[int, tuple[int, int]]) -> set[int]:
    """`roots` and every process descending from them."""
    found, grew = set(roots), True
    while grew:
        grew = False
        for pid, (parent, _) in processes.items():
            if parent in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def reap(run_id: str, driver: int, fd: int) -> None:
    """Wait for the lease to end, then end the run's processes: those that descended from the driver since the lease
    began (seen while it lived: its death orphans them to init), those carrying the run's id, and what they
    started."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends when its work is done, after the driver's
        signal.signal(s, signal.SIG_IGN)
    me = os.getpid()
    began = table()[me][1]  # what the driver started before the lease (an in-process caller's) is not the run's
    seen: dict[int, int] = {}  # pid -> start time
    released = False
    while os.getppid() == driver:
        processes = table()
        seen |= {pid: processes[pid][1] for pid in below({driver}, processes) - {driver, me}
                 if processes[pid][1] >= began}
        if select.select([fd], [], [], 0.5)[0]:
            released = os.read(fd, 1) == b"r"
            break
    ended, deadline = set(), time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        processes = table()
        known = {pid for pid, (_, started) in processes.items() if seen.get(pid) == started}  # not a reused pid
        left = below(known | marked(processes, run_id), processes) - {me, driver}
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    if ended and not released:
        print(f"megarl: the driver (pid {driver}) of run {run_id} is gone: ended the {len(ended)} processes it had "
              "started", file=sys.stderr, flush=True)


if __name__ == "__main__":
    reap(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
