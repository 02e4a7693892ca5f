"""Run a server command so that it ends when the process that started it ends, however that ends.

    python server_guard.py PARENT_PID COMMAND...

SGLangServer starts servers in sessions of their own, so that shutdown() ends a server's whole process
tree and nothing else. The price: nothing ends them when their owner dies without calling shutdown()
(the rollout actor under ray.kill, a benchmark under `timeout`), and a leftover server holds tens of GB
of the GPU through the next run. This guard sits between the owner and the server:

- the owner may be gone before anyone notices, so the guard polls its parent pid once a second (a
  PR_SET_PDEATHSIG on the guard would not do: it fires when the *thread* that started the guard exits,
  and the engine starts servers from a thread pool; it also needs preexec_fn, unsafe in the threaded
  owner). When the parent changed, the server gets SIGTERM, then the guard ends (below).
- the server is started with PR_SET_PDEATHSIG=SIGKILL (safe here: the guard is single-threaded and its
  one thread lives as long as it does), so it dies with the guard, also when the guard is SIGKILLed;
  SGLang's own schedulers die with the server the same way.
- SIGTERM to the session (SGLangServer.shutdown) reaches the guard and the server; the guard waits up
  to GRACE_S for the server to finish before it exits (taking the server with it).

Standard library only, run by path: it starts in milliseconds and imports nothing of megarl.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 20.0  # less than SGLangServer.shutdown's 30 s wait, so the guard ends it first
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    stopping: list[float] = []  # when the server was asked to stop

    def on_term(signum, frame):
        stopping.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    server = subprocess.Popen(command, preexec_fn=die_with_parent if sys.platform == "linux" else None)
    while True:
        try:
            code = server.wait(timeout=1.0)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if not stopping and os.getppid() != parent:  # the owner died without shutting the server down
            server.terminate()
            stopping.append(time.monotonic())
        if stopping and time.monotonic() - stopping[0] > GRACE_S:
            return 137  # exiting kills the server (PR_SET_PDEATHSIG)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
