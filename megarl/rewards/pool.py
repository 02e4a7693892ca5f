"""A reward function run in worker processes that are killed and replaced when a call runs too long
(reward.isolation=process).

A reward stuck inside one C call (a regex or a big-number computation that checks no signal, a ctypes
call) cannot be interrupted in the process that made the call, and a thread left running it holds the
process's GIL. So the calls run in worker processes, at most num_workers at once (started as needed,
reused from batch to batch); a call past its limit has its worker killed (with everything the worker
started, e.g. math-verify's checking process: each worker leads its own process group) and replaced,
and the sample fails. A worker's start-up is on no call's clock: a call's starts when it is sent.

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


class _Worker:
    """One worker process and the socket to it; `index`/`started`: the call it runs, if any."""

    def __init__(self, payload: bytes):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "megarl.rewards.worker", str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((sys.path, payload))  # the path: a reward's module must import there as it does here
        self.ready, self.born = False, time.monotonic()
        self.index: int | None = None
        self.started = 0.0

    def send(self, index: int, sample: dict) -> None:
        self.index, self.started = index, time.monotonic()
        self.conn.send((index, sample))

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: the worker and any process it started
        except ProcessLookupError:
            pass
        self.process.wait()
        self.conn.close()


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
        outcomes: list = [None] * len(samples)
        following = 0
        with self.lock:
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
                for worker in self.workers:
                    if worker.ready and worker.index is None and following < len(samples):
                        worker.send(following, samples[following])
                        following += 1
                    elif worker.index is not None and timeout_s and now - worker.started >= timeout_s:
                        outcomes[worker.index] = call_timeout(timeout_s)
                        self._replace(worker)
                    elif not worker.ready and now - worker.born > STARTUP_TIMEOUT_S:
                        raise RewardIsolationError(f"a reward process for {self.__name__!r} did not start within "
                                                   f"{STARTUP_TIMEOUT_S:g} s")
                ends = [w.started + timeout_s for w in self.workers if w.index is not None and timeout_s]
                ends += [w.born + STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
                ends += [deadline] if deadline is not None else []
                for conn in wait([w.conn for w in self.workers], max(min(ends) - now, 0.001) if ends else None):
                    self._receive(next(w for w in self.workers if w.conn is conn), outcomes)
        return outcomes

    def _receive(self, worker: _Worker, outcomes: list) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the process died: os._exit or a crash in the reward, or killed from outside
            status = worker.process.wait()
            if not worker.ready:
                raise RewardIsolationError(f"a reward process for {self.__name__!r} exited with status {status} "
                                           "while starting") from None
            if worker.index is not None:
                outcomes[worker.index] = RewardCallError(f"the reward process exited with status {status} during "
                                                         "the call")
            self._replace(worker)
            return
        if not worker.ready:
            worker.ready, problem = True, message
            if problem is not None:  # the function did not unpickle there
                raise RewardIsolationError(isolation_hint(self.__name__, problem))
            return
        index, outcome = message
        outcomes[index], worker.index = outcome, None

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.payload)
