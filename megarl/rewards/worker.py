"""A reward process (pool.py): `python -m megarl.rewards.worker FD`, FD a socket to the driver.

It receives the driver's sys.path, the pickled reward function and its address-space limit (where it has no memory
cgroup), becomes a child subreaper (what it daemonises stays below it: worker_limits.py), answers None when the
function is loaded (or the reason it is not), then for each sample (pickled by value, as the answer) answers the reward
or the exception that failed it, until the driver closes the socket. A reward's exception is sent as a
RewardCallError with its text and where it was raised (the exception itself may not unpickle in the driver);
a sample that does not unpickle here fails alone, the process goes on.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from megarl.rewards.scoring import RewardCallError, RewardTimeout, RewardValueError, call_reward
from megarl.rewards.worker_limits import become_subreaper, kill_below


def portable(error: Exception) -> Exception:
    if isinstance(error, (RewardCallError, RewardTimeout, RewardValueError)):  # megarl's own: they unpickle
        return error
    if isinstance(error, MemoryError):  # the driver names the limit and replaces this process
        return MemoryError(str(error))
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" (at {where.filename}:{where.lineno} in {where.name})" if where else ""
    return RewardCallError(f"{type(error).__name__}: {error}{at}")


def answer(outcome) -> bytes:
    """The pickled outcome, or the error that it cannot be pickled (one of megarl's errors holding an object)."""
    try:
        return pickle.dumps(outcome)
    except Exception as e:
        return pickle.dumps(RewardCallError(f"the reward's outcome cannot be sent back ({type(e).__name__}: {e}): "
                                            f"{type(outcome).__name__}"))


def exit_with_the_driver(driver: int) -> None:
    """Once the driver is gone (killed, so it could not kill us), end what we started and this process: a call
    stuck in C that releases the GIL (sleeps, ctypes, I/O) would otherwise keep it running."""
    while os.getppid() == driver:
        time.sleep(1.0)
    kill_below(os.getpid())
    os.killpg(0, signal.SIGKILL)


def main(fd: int) -> None:
    conn = Connection(fd)
    path, payload, address_space_mb = conn.recv()
    sys.path[:] = path
    become_subreaper()
    if address_space_mb:
        resource.setrlimit(resource.RLIMIT_AS, (address_space_mb << 20, address_space_mb << 20))
    threading.Thread(target=exit_with_the_driver, args=(os.getppid(),), daemon=True).start()
    try:
        fn = pickle.loads(payload)
    except Exception as e:  # e.g. its module does not import here
        conn.send(f"it does not unpickle in a fresh process ({type(e).__name__}: {e})")
        return
    conn.send(None)
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        try:
            sample = pickle.loads(data)
        except Exception as e:  # e.g. a field of a class that does not import here: the sample fails, not the process
            outcome = RewardCallError(f"the sample does not unpickle in the reward process ({type(e).__name__}: {e})")
        else:
            try:
                outcome = call_reward(fn, sample)
            except Exception as e:  # the sample fails, the process goes on
                outcome = portable(e)
        conn.send_bytes(answer(outcome))


if __name__ == "__main__":
    main(int(sys.argv[1]))
