"""A reward function run in worker processes that are killed and replaced when a call runs too long
(reward.isolation=process).

A reward stuck inside one C call (a regex or a big-number computation that checks no signal, a ctypes
call) cannot be interrupted in the process that made the call, and a thread left running it holds the
process's GIL. So the calls run in worker processes, at most num_workers at once (started as needed,
reused from batch to batch); a call past its limit has its worker killed (with everything the worker
started, e.g. math-verify's checking process) and replaced, and the sample fails. A worker's start-up is on
no call's clock: a call's starts when it is sent. A worker that dies (seen by its exit, not only its socket,
which a process it forked may hold open), a sample that does not pickle here or unpickle there, an answer that
does not come back: each fails its sample only, never waits.

Each worker is bounded with all it starts (worker_limits.py): resident memory (reward.worker_memory_mb; also a
memory cgroup where the host allows one, else a cap on each process's address space) and threads
(reward.worker_max_threads; also that cgroup's pids.max where the host has the pids controller), measured while a
call runs (every WATCH_INTERVAL_S) and after it; a call that passes a limit fails, named, and its worker is replaced,
as is a worker past reward.worker_max_calls calls or 3/4 of its memory after a call. A worker is ended with
everything below it, daemonised (double fork, setsid) or not.

Workers are plain interpreters (`python -m megarl.rewards.worker`), not multiprocessing children: they do
not re-import the driver's main module (megarl.train imports torch and megatron), and a reward may start
processes of its own (a multiprocessing child marked daemon may not). The reward function goes to them
pickled, so it must be importable by name: a module-level function, not a closure or an object holding a
lock (those run with reward.isolation=none).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Callable

from megarl.rewards.scoring import RewardCallError, batch_timeout, call_timeout
from megarl.rewards.worker_limits import (ADDRESS_SPACE_FACTOR, RECYCLE_FRACTION, RewardLimitError, Usage,
                                          WorkerLimits, end_worker, kill_group, usage)
from megarl.sandbox.cgroup import PREFIX, MemoryCgroups, oom_kills, refused_tasks

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
# a busy worker's memory and threads, with its descendants', are measured this often (a walk of its processes in
# /proc and a read of its cgroup's kills), and after each call
WATCH_INTERVAL_S = 0.5


class RewardIsolationError(RuntimeError):
    """The reward cannot run in a reward process."""


def isolation_hint(name: str, problem: str) -> str:
    return (f"reward {name!r} cannot run in a reward process: {problem}; set reward.isolation=none to run it in "
            f"the driver's process (a call stuck inside C then hangs the run)")


def exit_descriptor(process: subprocess.Popen) -> int:
    """A descriptor that becomes readable once `process` has exited: a pidfd (Linux >= 5.3), else (older kernels,
    RHEL 8's 4.18 among them) the read end of a pipe whose write end a thread closes when the process is reaped."""
    try:
        return os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        read, write = os.pipe()

        def close_on_exit() -> None:
            process.wait()
            os.close(write)

        threading.Thread(target=close_on_exit, name="megarl-reward-exit", daemon=True).start()
        return read


@functools.cache
def memory_cgroups() -> MemoryCgroups | None:
    """Where reward processes get their memory cgroups (found once per process: finding one creates a probe)."""
    cgroups, where = MemoryCgroups.find()
    if cgroups:
        remove_stale_cgroups(cgroups)
    logger.info("reward processes: memory bounded %s, threads %s (%s)",
                "for each with what it starts, by a cgroup" if cgroups else "per process (RLIMIT_AS)",
                "by the kernel and measured" if cgroups and cgroups.tasks_parent else "measured",
                f"{where}; {cgroups.tasks_where}" if cgroups else where)
    return cgroups


def remove_stale_cgroups(cgroups: MemoryCgroups) -> None:
    """Remove the empty cgroups of reward processes whose driver is gone (a SIGKILLed driver cannot)."""
    for parent in {cgroups.parent, cgroups.tasks_parent or cgroups.parent}:  # v1's task limits are apart
        for path in parent.glob(f"{PREFIX}reward-*"):
            if not os.path.exists(f"/proc/{path.name.split('-')[-2]}"):
                try:
                    path.rmdir()
                except OSError:  # it still holds a process, or another process removed it first
                    pass


class _Worker:
    """One worker process, the socket to it, a descriptor that is readable once the process has exited (its
    socket may outlive it in a process it forked), its memory cgroup and the cgroup whose pids.max bounds its tasks,
    if any; `index`/`started`: the call it runs, if any; `calls`: those it answered."""

    def __init__(self, payload: bytes, limits: WorkerLimits):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "megarl.rewards.worker", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), start_new_session=True)  # no terminal's Ctrl-C
        theirs.close()
        self.exited = exit_descriptor(self.process)
        self.conn = Connection(ours.detach())
        self.cgroups, self.cgroup, self.tasks_cgroup = memory_cgroups(), None, None
        try:
            if self.cgroups:  # joined before it receives the reward: everything the reward starts is inside
                # named by the driver's pid too: remove_stale_cgroups reads it
                self.cgroup = self.cgroups.create(f"reward-{os.getpid()}-{self.process.pid}", limits.memory_mb << 20,
                                                  max_tasks=limits.max_threads)
                self.tasks_cgroup = self.cgroups.tasks_dir(self.cgroup)
                self.cgroups.join(self.cgroup, self.process.pid)
            # the path: a reward's module must import there as it does here; the address space, where no cgroup
            self.conn.send((sys.path, payload, None if self.cgroup else limits.memory_mb * ADDRESS_SPACE_FACTOR))
        except OSError as e:
            self.kill()
            raise RewardIsolationError(f"cannot start a reward process in a memory cgroup ({e}); the log says "
                                       "where cgroups are created at start") from e
        self.ready, self.born = False, time.monotonic()
        self.index: int | None = None
        self.started, self.calls = 0.0, 0

    def kill(self) -> None:
        # and every process below it, daemonised or not; by pid only while the pid is its own (not yet reaped)
        alive = self.process.poll() is None
        end_worker(self.process.pid if alive else None, self.cgroup)
        if not alive:  # it died on its own, its children orphaned to init; those it did not move out of its group:
            kill_group(self.process.pid)
        self.process.wait()
        self.conn.close()
        os.close(self.exited)
        if self.cgroup:
            try:
                self.cgroups.remove(self.cgroup)
            except OSError as e:  # a process stuck in the kernel holds it: an empty cgroup left, nothing running
                logger.warning("cannot remove the reward process's cgroup %s: %s", self.cgroup, e)


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


class RewardPool:
    """`fn` run in worker processes bounded by `limits`; `score` calls `run_calls`."""

    def __init__(self, fn: Callable, name: str, limits: WorkerLimits):
        try:
            self.payload = pickle.dumps(fn)
        except Exception as e:  # closures, lambdas, objects holding locks or sockets
            raise RewardIsolationError(isolation_hint(name, f"it cannot be pickled ({type(e).__name__}: {e})")) from None
        self.fn, self.__name__, self.limits = fn, name, limits
        self.workers: list[_Worker] = []
        self.recycled = 0  # workers replaced for holding over RECYCLE_FRACTION of their memory after a call
        self.lock = threading.Lock()  # one batch at a time
        self._finalizer = weakref.finalize(self, _kill_all, self.workers)  # also at interpreter exit

    def close(self) -> None:
        self._finalizer()

    def run_calls(self, samples: list[dict], timeout_s: float | None, num_workers: int,
                  deadline: float | None) -> list:
        """One outcome per sample (a reward, or the exception that failed it), at most num_workers calls at once."""
        with self.lock:
            try:
                return self._run_calls(samples, timeout_s, num_workers, deadline)
            except BaseException:  # a worker's late answer must not be taken for a call of the next batch
                _kill_all(self.workers)
                raise

    def _run_calls(self, samples: list[dict], timeout_s: float | None, num_workers: int,
                   deadline: float | None) -> list:
        outcomes: list = [None] * len(samples)
        following, watched = 0, time.monotonic()
        while len(self.workers) < min(num_workers, len(samples)):
            self.workers.append(_Worker(self.payload, self.limits))
        while following < len(samples) or any(w.index is not None for w in self.workers):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                for worker in [w for w in self.workers if w.index is not None]:
                    outcomes[worker.index] = batch_timeout(started=True)
                    self._replace(worker)
                for i in range(following, len(samples)):
                    outcomes[i] = batch_timeout(started=False)
                break
            for worker in list(self.workers):
                if worker.ready and worker.index is None and following < len(samples):
                    self._send(worker, following, samples[following], outcomes)
                    following += 1
                elif worker.index is not None and timeout_s and now - worker.started >= timeout_s:
                    outcomes[worker.index] = call_timeout(timeout_s)
                    self._replace(worker)
                elif not worker.ready and now - worker.born > STARTUP_TIMEOUT_S:
                    raise RewardIsolationError(f"a reward process for {self.__name__!r} did not start within "
                                               f"{STARTUP_TIMEOUT_S:g} s")
            if following < len(samples) and any(w.ready and w.index is None for w in self.workers):
                continue  # a sample that could not be sent left its worker free
            ends = [w.started + timeout_s for w in self.workers if w.index is not None and timeout_s]
            ends += [w.born + STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
            ends += [deadline] if deadline is not None else []
            ends += [watched + WATCH_INTERVAL_S] if any(w.index is not None for w in self.workers) else []
            waits = {w.conn: w for w in self.workers} | {w.exited: w for w in self.workers}
            for ready in wait(list(waits), max(min(ends) - now, 0.001) if ends else None):
                worker = waits[ready]
                if worker not in self.workers:  # both its socket and its exit were ready: handled once
                    continue
                if ready is worker.conn or worker.conn.poll():  # an answer sent before it exited comes first
                    self._receive(worker, outcomes)
                else:
                    self._lost(worker, outcomes)
            if time.monotonic() >= watched + WATCH_INTERVAL_S:
                watched = time.monotonic()
                for worker in [w for w in self.workers if w.index is not None]:
                    breach, _ = self._measure(worker)
                    if breach:
                        outcomes[worker.index] = breach
                        self._replace(worker)
        return outcomes

    def _measure(self, worker: _Worker) -> tuple[RewardLimitError | None, Usage]:
        """The limit `worker` has passed, if any, and what it and its descendants hold."""
        used = usage(worker.process.pid)
        if worker.cgroup and oom_kills(worker.cgroup):  # a cgroup of its own: any kill there was its
            return self.limits.memory_breach(self.__name__, "the kernel killed a process in its reward process's "
                                                            "memory cgroup"), used
        if used.rss_bytes > self.limits.memory_mb << 20:
            return self.limits.memory_breach(self.__name__, f"its reward process and the processes it started held "
                                                            f"{used.rss_bytes >> 20} MiB"), used
        if refused_tasks(worker.tasks_cgroup):  # the kernel held it at its limit: a fork or thread start failed
            return self.limits.thread_refusal(self.__name__), used
        if used.threads > self.limits.max_threads:
            return self.limits.thread_breach(self.__name__, used.threads), used
        return None, used

    def _send(self, worker: _Worker, index: int, sample: dict, outcomes: list) -> None:
        # pickled by value: Connection.send would pass a torch tensor as shared memory, which only a multiprocessing
        # child can fetch (a worker has another authkey: "digest received was wrong")
        try:
            data = pickle.dumps(sample)
        except Exception as e:  # a field holding a lock, a generator, a local function
            outcomes[index] = RewardCallError(f"the sample cannot be sent to a reward process ({type(e).__name__}: "
                                              f"{e})")
            return
        worker.index, worker.started = index, time.monotonic()
        try:
            worker.conn.send_bytes(data)
        except OSError:  # the process died while idle (killed from outside)
            self._lost(worker, outcomes)

    def _receive(self, worker: _Worker, outcomes: list) -> None:
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):  # the process died, or closed its socket and runs on
            self._lost(worker, outcomes)
            return
        try:
            message = pickle.loads(data)
        except Exception as e:  # an exception raised by the reward that pickles there but does not unpickle here
            message = RewardCallError(f"the reward process's answer does not unpickle ({type(e).__name__}: {e})")
        if not worker.ready:
            worker.ready, problem = True, message
            if problem is not None:  # the function did not unpickle there
                raise RewardIsolationError(isolation_hint(self.__name__, problem))
            return
        index, worker.index = worker.index, None
        worker.calls += 1
        breach, used = self._measure(worker)
        if isinstance(message, MemoryError):  # its heap may be left fragmented: replaced too
            breach = breach or self.limits.memory_breach(self.__name__, f"an allocation failed (MemoryError: "
                                                                        f"{message})")
        outcomes[index] = breach or message
        over = used.rss_bytes > RECYCLE_FRACTION * (self.limits.memory_mb << 20)
        if over and not breach:
            self.recycled += 1
            (logger.warning if self.recycled == 1 else logger.debug)(
                "reward %r: a reward process held %d MiB after a call, over %g of reward.worker_memory_mb=%d: replaced "
                "(does the reward keep memory between calls?)", self.__name__, used.rss_bytes >> 20,
                RECYCLE_FRACTION, self.limits.memory_mb)
        if breach or over or (self.limits.max_calls and worker.calls >= self.limits.max_calls):
            self._replace(worker)

    def _lost(self, worker: _Worker, outcomes: list) -> None:
        """The worker exited (os._exit or a crash in the reward, killed from outside) or closed its socket: the
        call it ran fails; it is replaced."""
        killed = worker.cgroup is not None and oom_kills(worker.cgroup) > 0
        self._replace(worker)  # killed with what it started: a process it forked may hold its socket open
        status = worker.process.returncode
        why = (self.limits.memory_breach(self.__name__, "the kernel killed its reward process") if killed
               else RewardCallError(f"the reward process exited with status {status} during the call"))
        if not worker.ready:
            raise RewardIsolationError(f"a reward process for {self.__name__!r} exited with status {status} "
                                       f"while starting" + (f": {why}" if killed else ""))
        if worker.index is not None:
            outcomes[worker.index] = why

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.payload, self.limits)
