"""A sandbox for untrusted Python code (the `python` tool, code rewards).

Each run is a fresh process that executes one script in a private directory, under these limits:
wall-clock time (the process tree is killed), address space (RLIMIT_AS), processes (RLIMIT_NPROC),
file size (RLIMIT_FSIZE, which also bounds the captured stdout/stderr) and CPU time. Violations come
back in the SandboxResult (non-zero exit code, MemoryError traceback, `timed_out`); nothing is raised,
so a caller such as the agent loop passes them to the model as a tool error and goes on.

Isolation, strongest first; mode="auto" takes the strongest the host offers and logs which at start:

  bwrap       bubblewrap (Debian package `bubblewrap`): new user, mount, pid, network, ipc and uts
              namespaces. The file system is an empty root with read-only binds of only what Python
              needs (its prefix, /usr/lib), a private tmpfs /tmp, the run's directory at /sandbox, a
              fresh /proc of the sandbox's own pid namespace and a minimal /dev. No network (only a
              loopback of its own), no nested user namespaces, no capabilities.
  namespaces  util-linux `unshare` (no bubblewrap, user namespaces available): new user, pid, network,
              ipc, uts and mount namespaces with a fresh /proc. WEAKER: the host file system is
              visible; only file permissions protect it, so world-readable files can be read and
              world-writable directories (/tmp, /dev/shm) written.
  rlimits     no namespaces at all: rlimits, a private directory and (when started as root) a
              dedicated uid. WEAKEST: the network is reachable and the file system is guarded by file
              permissions only.

Started as root (as in CI), every run also drops to an unprivileged uid that no other run uses at
the same time (from uid_base up; a lock file per uid in the temp directory makes this hold across
processes): RLIMIT_NPROC counts processes per uid, so separate uids keep concurrent runs from eating
each other's process budget, and anything left by a run whose supervisor was killed is found by
uid. Started as an ordinary user, runs keep that user's uid; the process limit then counts the
user's other processes too (it is set to their number plus the budget), and in rlimits mode a child
that leaves the process group (setsid) can outlive the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MODES = ("bwrap", "namespaces", "rlimits")
SANDBOX_DIR = "/sandbox"  # where the run's directory appears inside the bwrap sandbox
UID_RANGE = 4096  # as root, runs take uids uid_base ... uid_base + UID_RANGE - 1

# The supervisor of one run, a separate process started as the caller's user: it sets the limits,
# drops to the sandbox uid, starts the sandbox command, enforces the wall-clock limit and, when the
# command ends, kills and reaps everything the run started. It is a "child subreaper", so processes
# the code daemonises come back to it rather than to the host's init (where, unreaped, they would
# keep counting against the uid's process limit). A separate process rather than subprocess's
# preexec_fn, which is unsafe in a multi-threaded parent (the agent loop runs tools in threads).
_SUPERVISOR = r"""
import ctypes, json, os, resource, signal, sys, time
spec = json.loads(sys.argv[1])
status = open(spec["status"], "w")  # opened before dropping privileges; not inherited by the run
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
os.chdir(spec["cwd"])
child = os.fork()
if child == 0:
    os.nice(10)  # below us: the code (a fork bomb, say) must never starve the process enforcing its limits
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
deadline, code, timed_out = time.monotonic() + spec["wall_s"], None, False
while code is None:
    pid, wait_status = os.waitpid(child, os.WNOHANG)
    if pid:
        code = os.waitstatus_to_exitcode(wait_status)
    elif time.monotonic() > deadline:
        timed_out = True
        break
    else:
        time.sleep(0.005)
me = str(os.getpid())
while True:  # kill our children until none are left; orphaned descendants become our children meanwhile
    if spec["uid"] is not None:
        # the uid is the run's alone: kill(-1) reaches every process of it (but us) in one step that
        # no fork can race, where killing children one by one can trail a fork bomb on a busy machine
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing left to signal (only in a PID namespace that holds just us)
            pass
    else:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        os.kill(int(entry), signal.SIGKILL)
            except (OSError, IndexError):
                pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break
    time.sleep(0.001)
json.dump({"exit_code": code, "timed_out": timed_out}, status)
"""


@dataclass
class SandboxLimits:
    wall_s: float = 5.0  # the whole process tree is killed after this long
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_processes: int = 16  # processes and threads the code may start, besides itself
    max_file_mb: int = 16  # largest file the code may write; stdout and stderr count as files
    max_output_bytes: int = 16384  # how much of stdout and of stderr comes back
    max_open_files: int = 64


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when timed out; killed by a signal: -signal (bwrap reports 128 + signal)
    timed_out: bool
    output_truncated: bool
    seconds: float
    run_id: str  # also the script's argv[1], so its processes can be found in /proc while it runs

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass
class _Python:
    executable: str  # resolved path
    ro_paths: list[str] = field(default_factory=list)  # what it needs to run, bound read-only under bwrap


class Sandbox:
    """Runs Python source in an isolated process; at most `slots` runs at a time (others wait)."""

    def __init__(self, limits: SandboxLimits | None = None, mode: str = "auto", python: str | None = None,
                 slots: int = 4, uid_base: int = 1_500_000, extra_ro_paths: tuple[str, ...] = ()):
        if mode not in ("auto",) + MODES:
            raise ValueError(f"sandbox mode '{mode}' is not one of auto, {', '.join(MODES)}")
        self.limits = limits or SandboxLimits()
        self.as_root = os.geteuid() == 0
        self.uid_base = uid_base
        self._lost_uids: set[int] = set()  # uids left with processes nothing could remove
        self._slots = threading.BoundedSemaphore(slots)
        # root-owned and not listable: a run's uid may enter only its own directory below it
        self.root = Path(tempfile.mkdtemp(prefix="megarl-sandbox-"))
        self.root.chmod(0o711)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
        self.python = self._find_python(python, extra_ro_paths)
        self.mode = self._choose_mode(mode)
        note = {"bwrap": "full isolation: namespaces, a minimal read-only file system, no network",
                "namespaces": "WEAKER: the host file system is visible, protected only by file permissions; "
                              "install the Debian package 'bubblewrap' for full isolation",
                "rlimits": "WEAKEST: the network is reachable and the file system is protected only by file "
                           "permissions"}[self.mode]
        (logger.info if self.mode == "bwrap" else logger.warning)(
            "sandbox mode '%s' (%s), python %s, uid %s", self.mode, note, self.python.executable,
            f"{uid_base} and up" if self.as_root else f"{os.getuid()} (not root: runs keep the caller's uid)")

    def run(self, code: str, stdin: str = "", wall_s: float | None = None) -> SandboxResult:
        """Run `code` as a script; returns when it exits or when its wall-clock limit (`wall_s`, by
        default limits.wall_s) kills it."""
        with self._slots, self._dedicated_uid() as uid:
            return self._run(code, stdin, uid, self.mode, self.python, wall_s or self.limits.wall_s)

    def close(self) -> None:
        self._finalizer()

    @contextlib.contextmanager
    def _dedicated_uid(self):
        """As root: a uid no other run uses meanwhile, in this process or any other (an flock per uid,
        so sandboxes of several workers on one host never share one). Otherwise None."""
        if not self.as_root:
            yield None
            return
        for uid in range(self.uid_base, self.uid_base + UID_RANGE):
            lock = open(Path(tempfile.gettempdir()) / f"megarl-sandbox-uid-{uid}.lock", "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            try:
                # what a run whose supervisor was killed left behind; a uid whose leftovers outlive
                # SIGKILL (zombies under an init that does not reap) would fail every later fork
                if uid in self._lost_uids or not self._kill_leftovers(uid):
                    self._lost_uids.add(uid)
                    continue
                yield uid
            finally:
                lock.close()
            return
        raise RuntimeError(f"all {UID_RANGE} sandbox uids from {self.uid_base} are in use")

    # --- one run ---------------------------------------------------------------------------------

    def _run(self, code: str, stdin: str, uid: int | None, mode: str, python: _Python,
             wall_s: float) -> SandboxResult:
        run_id = uuid.uuid4().hex
        work = self.root / run_id
        work.mkdir(mode=0o700)
        outputs = self.root / f"{run_id}.out"
        outputs.mkdir(mode=0o700)  # outside what the code can reach: it only holds the open files
        try:
            (work / "main.py").write_text(code)
            (outputs / "stdin").write_text(stdin)
            if uid is not None:
                os.chown(work, uid, uid)
            spec = {"rlimits": self._rlimits(mode, uid, wall_s), "uid": uid, "cwd": str(work), "wall_s": wall_s,
                    "argv": self._command(mode, python, work, run_id), "status": str(outputs / "status"),
                    "env": {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_DIR if mode == "bwrap" else str(work),
                            "LANG": "C.UTF-8"}}
            start = time.monotonic()
            with open(outputs / "stdin", "rb") as fin, open(outputs / "stdout", "wb") as fout, \
                    open(outputs / "stderr", "wb") as ferr:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SUPERVISOR, json.dumps(spec)],
                                        stdin=fin, stdout=fout, stderr=ferr, env={}, start_new_session=True)
                try:
                    proc.wait(timeout=wall_s + 10)
                except subprocess.TimeoutExpired:  # only if the supervisor itself was stopped or killed
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            seconds = time.monotonic() - start
            self._kill_leftovers(uid)
            try:
                report = json.loads((outputs / "status").read_text())
            except ValueError:  # the supervisor died before reporting (the code killed it: same uid)
                report = {"exit_code": proc.returncode, "timed_out": seconds > wall_s}
            stdout, cut_out = self._read(outputs / "stdout")
            stderr, cut_err = self._read(outputs / "stderr")
            return SandboxResult(stdout, stderr, report["exit_code"], report["timed_out"], cut_out or cut_err, seconds,
                                 run_id)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(outputs, ignore_errors=True)

    def _command(self, mode: str, python: _Python, work: Path, run_id: str) -> list[str]:
        script = [python.executable, "-I", "-B", "main.py", run_id]
        if mode == "bwrap":
            ro = [a for p in python.ro_paths for a in ("--ro-bind", p, p)]
            return [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
                    "--die-with-parent", "--new-session",
                    "--tmpfs", "/tmp", *ro, *_merged_usr_links(),  # the tmpfs first: python may live under /tmp
                    "--bind", str(work), SANDBOX_DIR, "--chdir", SANDBOX_DIR,
                    "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--", *script]
        if mode == "namespaces":
            return [shutil.which("unshare"), "--user", "--map-current-user", "--net", "--pid", "--ipc", "--uts",
                    "--mount", "--mount-proc", "--fork", "--kill-child", "--", *script]
        return script

    def _rlimits(self, mode: str, uid: int | None, wall_s: float) -> dict[str, int]:
        supervisors = {"bwrap": 2, "namespaces": 1, "rlimits": 0}[mode]  # their own processes
        nproc = 2 + self.limits.max_processes + supervisors  # + the script and our supervisor
        if uid is None:  # the caller's uid: its other processes count against the limit as well
            nproc += _count_processes(os.getuid())
        return {"RLIMIT_AS": self.limits.memory_mb << 20, "RLIMIT_NPROC": nproc,
                "RLIMIT_FSIZE": self.limits.max_file_mb << 20, "RLIMIT_NOFILE": self.limits.max_open_files,
                "RLIMIT_CPU": int(wall_s) + 2, "RLIMIT_CORE": 0}

    def _read(self, path: Path) -> tuple[str, bool]:
        with open(path, "rb") as f:
            data = f.read(self.limits.max_output_bytes + 1)
        cut = len(data) > self.limits.max_output_bytes
        return data[:self.limits.max_output_bytes].decode("utf-8", "replace"), cut

    def _kill_leftovers(self, uid: int | None) -> bool:
        """Kill what a run whose supervisor was killed left behind, found by its dedicated uid; False
        when some of it is still there after 5 s."""
        if uid is None:
            return True  # not root: the uid is the caller's own
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            alive = _processes_of(uid)
            if not alive:
                return True
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        logger.warning("sandbox uid %d still has processes %s after 5 s of SIGKILL", uid, _processes_of(uid))
        return False

    # --- set-up checks -----------------------------------------------------------------------------

    def _probe(self, mode: str, python: _Python) -> SandboxResult:
        with self._dedicated_uid() as uid:
            return self._run("import sys; print(sys.base_prefix); print(sys.base_exec_prefix)", "", uid, mode, python,
                             max(self.limits.wall_s, 10.0))

    def _find_python(self, python: str | None, extra_ro_paths: tuple[str, ...]) -> _Python:
        """The first interpreter the sandbox uid can run (a venv under /root, for instance, it cannot)."""
        candidates = [python] if python else [getattr(sys, "_base_executable", sys.executable), sys.executable,
                                              "/usr/bin/python3", shutil.which("python3")]
        tried = []
        for candidate in dict.fromkeys(c for c in candidates if c):
            exe = os.path.realpath(candidate)
            result = self._probe("rlimits", _Python(exe))
            if result.ok:
                prefixes = result.stdout.split()
                ro = [*prefixes, str(Path(exe).parent), "/usr/lib", "/usr/lib64", *extra_ro_paths]
                ro = [p for p in dict.fromkeys(os.path.realpath(p) for p in ro) if os.path.exists(p)]
                # a path inside another bound path needs no bind of its own
                ro = [p for p in ro if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in ro)]
                return _Python(exe, ro)
            tried.append(f"{exe}: {(result.stderr.strip().splitlines() or [f'exit {result.exit_code}'])[-1]}")
        raise RuntimeError("no Python interpreter the sandbox user can run; tried " + "; ".join(tried)
                           + ". Pass python=<path to an interpreter readable by all users>")

    def _choose_mode(self, mode: str) -> str:
        tools = {"bwrap": "bwrap", "namespaces": "unshare"}
        failures = []
        for candidate in (MODES if mode == "auto" else (mode,)):
            if candidate in tools and not shutil.which(tools[candidate]):
                failures.append(f"{candidate}: '{tools[candidate]}' is not installed")
                continue
            result = self._probe(candidate, self.python)
            if result.ok:
                if failures:
                    logger.warning("sandbox: stronger modes unavailable: %s", "; ".join(failures))
                return candidate
            failures.append(f"{candidate}: {result.stderr.strip()[-300:] or f'exit {result.exit_code}'}")
        raise RuntimeError(f"sandbox mode '{mode}' does not work on this host: " + "; ".join(failures))


def _merged_usr_links() -> list[str]:
    """Recreate /bin, /lib, /lib64, /sbin as the host has them: symlinks into /usr, or read-only binds."""
    args = []
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top) and top != "/sbin":
            args += ["--ro-bind", top, top]
    return args


def _process_uids():
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited meanwhile
            continue
        if not status.get("State", "").strip().startswith("Z"):  # zombies hold no resources
            yield int(entry.name), int(status["Uid"].split()[0])


def _processes_of(uid: int) -> list[int]:
    return [pid for pid, owner in _process_uids() if owner == uid]


def _count_processes(uid: int) -> int:
    """Processes (with their threads) of `uid`: what RLIMIT_NPROC counts."""
    total = 0
    for pid in _processes_of(uid):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return total

