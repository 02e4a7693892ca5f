"""A reward function run in worker processes that are killed and replaced when a call runs too long
(reward.isolation=process).

A reward stuck inside one C call (a regex or a big-number computation that checks no signal, a ctypes
call) cannot be interrupted in the process that made the call, and a thread left running it holds the
process's GIL. So the calls run in worker processes, at most num_workers at once (started as needed,
reused from batch to batch); a call past its limit has its worker killed (with everything the worker
started, e.g. math-verify's checking process: each worker leads its own process group) and replaced,
and the sample fails. A worker's start-up is on no call's clock: a call's starts when it is sent. A worker
that dies (seen by its exit, not only its socket, which a process it forked may hold open), a sample that does
not pickle here or unpickle there, an answer that does not come back: each fails its sample only, never waits.

Workers are plain interpreters (`python -m megarl.rewards.worker`), not multiprocessing children: they do
not re-import the driver's main module (megarl.train imports torch and megatron), and a reward may start
processes of its own (a multiprocessing child marked daemon may not). The reward function goes to them
pickled, so it must be importable by name: a module-level function, not a closure or an object holding a
lock (those run with reward.isolation=none).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Callable

from megarl.rewards.scoring import RewardCallError, batch_timeout, call_timeout

STARTUP_TIMEOUT_S = 60.0


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


class _Worker:
    """One worker process, the socket to it and a descriptor that is readable once the process has exited (its
    socket may outlive it in a process it forked); `index`/`started`: the call it runs, if any."""

    def __init__(self, payload: bytes):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "megarl.rewards.worker", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.exited = exit_descriptor(self.process)
        self.conn = Connection(ours.detach())
        self.conn.send((sys.path, payload))  # the path: a reward's module must import there as it does here
        self.ready, self.born = False, time.monotonic()
        self.index: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: the worker and any process it started
        except ProcessLookupError:
            pass
        self.process.wait()
        self.conn.close()
        os.close(self.exited)


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


class RewardPool:
    """`fn` run in worker processes; `score` calls `run_calls`."""

    def __init__(self, fn: Callable, name: str):
        try:
            self.payload = pickle.dumps(fn)
        except Exception as e:  # closures, lambdas, objects holding locks or sockets
            raise RewardIsolationError(isolation_hint(name, f"it cannot be pickled ({type(e).__name__}: {e})")) from None
        self.fn, self.__name__ = fn, name
        self.workers: list[_Worker] = []
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
        following = 0
        while len(self.workers) < min(num_workers, len(samples)):
            self.workers.append(_Worker(self.payload))
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
            waits = {w.conn: w for w in self.workers} | {w.exited: w for w in self.workers}
            for ready in wait(list(waits), max(min(ends) - now, 0.001) if ends else None):
                worker = waits[ready]
                if worker not in self.workers:  # both its socket and its exit were ready: handled once
                    continue
                if ready is worker.conn or worker.conn.poll():  # an answer sent before it exited comes first
                    self._receive(worker, outcomes)
                else:
                    self._lost(worker, outcomes)
        return outcomes

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
        outcomes[worker.index], worker.index = message, None

    def _lost(self, worker: _Worker, outcomes: list) -> None:
        """The worker exited (os._exit or a crash in the reward, killed from outside) or closed its socket: the
        call it ran fails; it is replaced."""
        self._replace(worker)  # killed with what it started: a process it forked may hold its socket open
        status = worker.process.returncode
        if not worker.ready:
            raise RewardIsolationError(f"a reward process for {self.__name__!r} exited with status {status} "
                                       "while starting")
        if worker.index is not None:
            outcomes[worker.index] = RewardCallError(f"the reward process exited with status {status} during "
                                                     "the call")

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.payload)
