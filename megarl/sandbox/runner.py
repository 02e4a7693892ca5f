"""A sandbox for untrusted Python code (the `python` tool, code rewards).

Each run is a fresh process that executes one script in a private directory, under these limits:
wall-clock time (the process tree is killed), memory (below), processes (RLIMIT_NPROC), file size
(RLIMIT_FSIZE, which also bounds the captured stdout/stderr) and CPU time. Violations come back in
the SandboxResult (non-zero exit code, MemoryError traceback, `timed_out`); nothing is raised, so a
caller such as the agent loop passes them to the model as a tool error and goes on.

Memory is bounded per run, not per process: where this process may create memory cgroups (v2 or v1;
root in most containers) each run gets one of `memory_mb` (plus the supervisor's own share), and may
start up to `max_processes` more processes. Elsewhere a run may start no process or thread at all
(a harness run: its one child), each process keeping RLIMIT_AS = memory_mb (less the private /tmp and
/dev/shm, below), so processes x limit stays within the budget. The log says which at start.

Isolation. Only bwrap keeps a program to its own files; mode="auto" means bwrap, and is an error
naming how to install bubblewrap or opt in where it does not work. The weaker modes run only when
named by their unsafe- names, so that every config and log line that names one says what it is:

  bwrap              bubblewrap (Debian package `bubblewrap`): new user, mount, pid, network, ipc and
                     uts namespaces. The file system is an empty root with read-only binds of only what
                     Python needs (its prefix, /usr/lib), the run's directory at /sandbox, a fresh /proc
                     of the sandbox's own pid namespace and a read-only minimal /dev. No network (only a
                     loopback of its own), no nested user namespaces, no capabilities.
  unsafe-namespaces  util-linux `unshare` (no bubblewrap, user namespaces available): new user, pid,
                     network, ipc, uts and mount namespaces with a fresh /proc; the megarl checkout, the
                     caller's working directory and home are hidden under empty read-only tmpfs (the
                     run's directory and Python are bound back where they live); no capabilities. UNSAFE:
                     the rest of the host file system (data sets included) is visible, protected only by
                     file permissions.
  unsafe-rlimits     no namespaces at all: rlimits, a private directory as working directory, HOME and
                     TMPDIR, and (when started as root) a dedicated uid. UNSAFE: the network (127.0.0.1
                     included), the host file system and, for a non-root caller, the caller itself (same
                     uid: its environment, its memory, signals) are all reachable. A file written by path
                     outside the private directory stays on the host; as root, those the run's uid left
                     directly in /tmp, /var/tmp or /dev/shm are removed after it.

Temporary files are memory: in bwrap and unsafe-namespaces, /tmp (with /var/tmp) and /dev/shm are
private tmpfs of limits.tmp_mb each. A memory cgroup counts them with the run's processes; without
one, each process's address space is memory_mb less both, so the run stays within memory_mb.

Started as root (as in CI), every run also drops to an unprivileged uid that no other run uses at
the same time (from uid_base up; a lock file per uid in the temp directory makes this hold across
processes): RLIMIT_NPROC counts processes per uid, so separate uids keep concurrent runs from eating
each other's process budget, and anything left by a run whose supervisor was killed is found by
uid. Started as an ordinary user, runs keep that user's uid; the process limit then counts the
user's other processes too (it is set to their number plus the budget), and in rlimits mode a child
that leaves the process group (setsid) can outlive the run.

A run may also get a private input and output (`private_input`): an in-memory file and a pipe passed
as inherited file descriptors (their numbers follow the run id in argv), that exist nowhere on any
file system and that no wrapper process inside the sandbox keeps open. The test harness
(harness.py) carries its secret and verdict on them.
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

from megarl.sandbox.cgroup import MemoryCgroups
from megarl.utils.processes import kill_until_gone

logger = logging.getLogger(__name__)

MODES = ("bwrap", "unsafe-namespaces", "unsafe-rlimits")
# what each mode that is not bwrap leaves open: the refusal of its short name says it
UNSAFE = {"unsafe-namespaces": "the host's files outside /tmp, the checkout, the working directory and home "
                               "(data sets included) are readable wherever file permissions allow",
          "unsafe-rlimits": "the host's files (the checkout and data sets included), the network (127.0.0.1 "
                            "included) and, for a non-root caller, the caller's own processes are reachable"}
SANDBOX_DIR = "/sandbox"  # where the run's directory appears inside the bwrap sandbox
UID_RANGE = 4096  # as root, runs take uids uid_base ... uid_base + UID_RANGE - 1
SUPERVISOR_MB = 32  # the supervisor's own memory, inside the run's cgroup beside the code's budget
INSTALL = ("install bubblewrap (apt-get install -y bubblewrap on Debian/Ubuntu, dnf install bubblewrap on Fedora; "
           "the megarl image has it) and allow unprivileged user namespaces")
OPT_IN = ("or, knowing what it leaves open, name a weaker mode: the code reward's reward.code_sandbox="
          "unsafe-namespaces or unsafe-rlimits (the python tool: {\"name\": \"python\", \"mode\": "
          "\"unsafe-rlimits\"})")

# The supervisor of one run, a separate process started as the caller's user: it joins the run's
# memory cgroup, sets the limits, drops to the sandbox uid, starts the sandbox command, enforces the
# wall-clock limit and, when the command ends, kills and reaps everything the run started. It is a
# "child subreaper", so processes the code daemonises come back to it rather than to the host's init
# (where, unreaped, they would keep counting against the uid's process limit). A separate process
# rather than subprocess's preexec_fn, which is unsafe in a multi-threaded parent (the agent loop
# runs tools in threads). Not dumpable, and it closes the private channel once the command has it:
# code of the same uid can read neither through /proc/<supervisor>/fd.
_SUPERVISOR = r"""
import ctypes, json, os, resource, signal, sys, time
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None)
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
status = open(spec["status"], "w")  # opened before dropping privileges; not inherited by the run
if spec["cgroup"]:
    with open(spec["cgroup"], "w") as f:
        f.write(str(os.getpid()))
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
    libc.prctl(4, 0, 0, 0, 0)  # (a uid change resets it)
os.chdir(spec["cwd"])
child = os.fork()
if child == 0:
    os.nice(10)  # below us: the code (a fork bomb, say) must never starve the process enforcing its limits
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
for fd in spec["private_fds"]:
    os.close(fd)
deadline, code, timed_out = time.monotonic() + spec["wall_s"], None, False
while code is None:
    pid, wait_status = os.waitpid(child, os.WNOHANG)
    if pid:
        code = os.waitstatus_to_exitcode(wait_status)
    elif time.monotonic() > deadline:
        timed_out = True
        break
    elif os.getppid() != spec["caller"]:  # the caller died (killed with its run): nobody waits for this run
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

# unsafe-namespaces mode, inside the new namespaces and as root of the new user namespace: a private tmpfs of
# tmp_mb at /tmp (bound at /var/tmp too) and at /dev/shm; empty read-only tmpfs over what the code must not see;
# the run's directory and Python bound back where they live, then every capability given up for good
# (securebits: uid 0 gains none at exec) before the script starts.
_NAMESPACE_SETUP = r"""
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def mount(source, target, fstype, flags, data):
    if libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags, data and data.encode()):
        raise OSError(ctypes.get_errno(), f"mount {target}")
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
kept = {path: os.open(path, os.O_PATH) for path in spec["keep"]}
for path in spec["hide"]:
    if path == "/var/tmp" and "/tmp" in spec["hide"]:
        mount("/tmp", path, None, MS_BIND, None)  # one size for both
    else:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_mb']}m,mode=1777")
for path, fd in kept.items():
    os.makedirs(path, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
    if path != spec["cwd"]:
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    os.close(fd)
for path in spec["hide"]:
    if path not in ("/tmp", "/var/tmp", "/dev/shm") and path not in kept:  # hidden, not for files
        mount("none", path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
os.chdir(spec["cwd"])
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails past the last capability)
if libc.prctl(28, 1 | 2 | 32 | 64 | 128, 0, 0, 0):  # PR_SET_SECUREBITS: NOROOT, KEEP_CAPS, NO_CAP_AMBIENT_RAISE, locked
    raise OSError(ctypes.get_errno(), "securebits")
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
os.execv(spec["argv"][0], spec["argv"])
"""


@dataclass
class SandboxLimits:
    wall_s: float = 5.0  # the whole process tree is killed after this long
    memory_mb: int = 512  # memory of the whole run (module docstring), and the address space of each process
    max_processes: int = 16  # processes and threads the code may start, besides itself (with a memory cgroup)
    max_file_mb: int = 16  # largest file the code may write; stdout and stderr count as files
    max_output_bytes: int = 16384  # how much of stdout, of stderr and of the private output comes back
    max_open_files: int = 64

    @property
    def tmp_mb(self) -> int:
        """Size of the private /tmp, and of /dev/shm: an eighth of memory_mb each, inside it (module docstring)."""
        return max(1, self.memory_mb // 8)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when timed out; killed by a signal: -signal (bwrap reports 128 + signal)
    timed_out: bool
    output_truncated: bool
    seconds: float
    run_id: str  # also the script's argv[1], so its processes can be found in /proc while it runs
    private_output: bytes = b""  # what the script wrote on its private output (run(private_input=...))

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
        if f"unsafe-{mode}" in UNSAFE:
            raise ValueError(f"sandbox mode '{mode}' does not keep a program to its own files: {UNSAFE['unsafe-' + mode]}"
                             f". Use bwrap (mode 'auto'): {INSTALL}; or, to run it anyway, name it 'unsafe-{mode}' "
                             f"(the code reward: reward.code_sandbox=unsafe-{mode})")
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
        self.cgroups, where = MemoryCgroups.find()
        self.python = self._find_python(python, extra_ro_paths)
        self.mode = self._choose_mode(mode)
        note = "full isolation: namespaces, a minimal read-only file system, no network" if self.mode == "bwrap" \
            else f"UNSAFE, chosen by name: {UNSAFE[self.mode]}"
        (logger.info if self.mode == "bwrap" else logger.warning)(
            "sandbox mode '%s' (%s), python %s, uid %s", self.mode, note, self.python.executable,
            f"{uid_base} and up" if self.as_root else f"{os.getuid()} (not root: runs keep the caller's uid)")
        if self.cgroups:
            logger.info("sandbox memory: %d MiB per run, all its processes together (%s)", self.limits.memory_mb,
                        where)
        else:
            logger.warning("sandbox memory: %d MiB per process and no further process or thread per run (no "
                           "memory cgroup: %s)", self.limits.memory_mb, where)

    @property
    def memory_bound(self) -> str:
        """How a run's memory is bounded: 'cgroup' (all its processes together) or 'one process'."""
        return "cgroup" if self.cgroups else "one process"

    def run(self, code: str, stdin: str = "", wall_s: float | None = None, files: dict[str, str] | None = None,
            private_input: bytes | None = None) -> SandboxResult:
        """Run `code` as a script; returns when it exits or when its wall-clock limit (`wall_s`, by
        default limits.wall_s) kills it. `files` are written into its directory beside it. With
        `private_input`, the script is a trusted harness of two processes (the module docstring)."""
        with self._slots, self._dedicated_uid() as uid:
            return self._run(code, stdin, uid, self.mode, self.python, wall_s or self.limits.wall_s, files or {},
                             private_input)

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

    def _run(self, code: str, stdin: str, uid: int | None, mode: str, python: _Python, wall_s: float,
             files: dict[str, str], private_input: bytes | None) -> SandboxResult:
        run_id = uuid.uuid4().hex
        work = self.root / run_id
        work.mkdir(mode=0o700)
        outputs = self.root / f"{run_id}.out"
        outputs.mkdir(mode=0o700)  # outside what the code can reach: it only holds the open files
        cgroup, private_fds, private_out = None, [], None
        try:
            if self.cgroups:
                cgroup = self.cgroups.create(run_id, (self.limits.memory_mb + SUPERVISOR_MB) << 20)
            for name, text in {**files, "main.py": code}.items():
                (work / name).write_text(text)
            (outputs / "stdin").write_text(stdin)
            if uid is not None:
                os.chown(work, uid, uid)
            args = [run_id]
            if private_input is not None:  # an in-memory file to read, a pipe to write: no path anywhere
                private_in = os.memfd_create("megarl-sandbox-input")
                os.write(private_in, private_input)
                os.lseek(private_in, 0, os.SEEK_SET)
                private_out, write_end = os.pipe()
                private_fds = [private_in, write_end]
                args += [str(fd) for fd in private_fds]
            env = {"PATH": "/usr/bin:/bin", "HOME": SANDBOX_DIR if mode == "bwrap" else str(work), "LANG": "C.UTF-8",
                   # a pool per core would need processes or threads the run may not have
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            if mode == "unsafe-rlimits":
                env["TMPDIR"] = str(work)  # the other modes have a private /tmp instead
            spec = {"rlimits": self._rlimits(mode, uid, wall_s, harness=private_input is not None), "uid": uid,
                    "caller": os.getpid(),
                    "cwd": str(work), "wall_s": wall_s, "argv": self._command(mode, python, work, args),
                    "status": str(outputs / "status"), "env": env, "private_fds": private_fds,
                    "cgroup": str(cgroup / "cgroup.procs") if cgroup else None}
            start = time.monotonic()
            with open(outputs / "stdin", "rb") as fin, open(outputs / "stdout", "wb") as fout, \
                    open(outputs / "stderr", "wb") as ferr:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SUPERVISOR, json.dumps(spec)],
                                        stdin=fin, stdout=fout, stderr=ferr, env={}, start_new_session=True,
                                        pass_fds=private_fds)
                for fd in private_fds:  # ours; the write end must close here for the read to see its end
                    os.close(fd)
                private_fds = []
                try:
                    proc.wait(timeout=wall_s + 10)
                except subprocess.TimeoutExpired:  # only if the supervisor itself was stopped or killed
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            seconds = time.monotonic() - start
            self._kill_leftovers(uid)
            if mode == "unsafe-rlimits" and uid is not None:
                _remove_temporary_files_of(uid)
            try:
                report = json.loads((outputs / "status").read_text())
            except ValueError:  # the supervisor died before reporting (the code killed it: same uid)
                report = {"exit_code": proc.returncode, "timed_out": seconds > wall_s}
            stdout, cut_out = self._read(outputs / "stdout")
            stderr, cut_err = self._read(outputs / "stderr")
            private = self._read_private(private_out) if private_out is not None else b""
            return SandboxResult(stdout, stderr, report["exit_code"], report["timed_out"], cut_out or cut_err, seconds,
                                 run_id, private)
        finally:
            for fd in private_fds + ([private_out] if private_out is not None else []):
                os.close(fd)
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(outputs, ignore_errors=True)
            if cgroup:
                self.cgroups.remove(cgroup)

    def _command(self, mode: str, python: _Python, work: Path, args: list[str]) -> list[str]:
        script = [python.executable, "-I", "-B", "main.py", *args]
        if mode == "bwrap":
            ro = [a for p in python.ro_paths for a in ("--ro-bind", p, p)]
            tmp = str(self.limits.tmp_mb << 20)
            # /dev (bwrap's own tmpfs, of no size limit) read-only, with a sized tmpfs at /dev/shm; /tmp first: python
            # may live there
            return [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
                    "--die-with-parent", "--new-session",
                    "--size", tmp, "--tmpfs", "/tmp", "--symlink", "/tmp", "/var/tmp", *ro, *_merged_usr_links(),
                    "--bind", str(work), SANDBOX_DIR, "--chdir", SANDBOX_DIR, "--proc", "/proc",
                    "--dev", "/dev", "--size", tmp, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                    "--remount-ro", "/", "--", *script]
        if mode == "unsafe-namespaces":
            hide = _private_paths()
            keep = [str(work)] + [p for p in python.ro_paths if any(_inside(p, h) for h in hide)]
            setup = {"hide": hide, "keep": keep, "cwd": str(work), "argv": script, "tmp_mb": self.limits.tmp_mb}
            return [shutil.which("unshare"), "--map-root-user", "--net", "--pid", "--ipc", "--uts", "--mount",
                    "--mount-proc", "--fork", "--kill-child", "--",
                    python.executable, "-I", "-S", "-c", _NAMESPACE_SETUP, json.dumps(setup)]
        return script

    def _rlimits(self, mode: str, uid: int | None, wall_s: float, harness: bool) -> dict[str, int]:
        supervisors = {"bwrap": 2, "unsafe-namespaces": 1, "unsafe-rlimits": 0}[mode]  # their own processes
        # our supervisor, the script (a harness: and its child), and only with a cgroup to bound their
        # memory together, the processes the code may start
        nproc = 2 + harness + supervisors + (self.limits.max_processes if self.cgroups else 0)
        if uid is None:  # the caller's uid: its other processes count against the limit as well
            nproc += _count_processes(os.getuid())
        memory_mb = self.limits.memory_mb
        if not self.cgroups and mode != "unsafe-rlimits":  # the private /tmp and /dev/shm hold memory of the budget
            memory_mb -= 2 * self.limits.tmp_mb
        return {"RLIMIT_AS": memory_mb << 20, "RLIMIT_NPROC": nproc,
                "RLIMIT_FSIZE": self.limits.max_file_mb << 20, "RLIMIT_NOFILE": self.limits.max_open_files,
                "RLIMIT_CPU": int(wall_s) + 2, "RLIMIT_CORE": 0}

    def _read(self, path: Path) -> tuple[str, bool]:
        with open(path, "rb") as f:
            data = f.read(self.limits.max_output_bytes + 1)
        cut = len(data) > self.limits.max_output_bytes
        return data[:self.limits.max_output_bytes].decode("utf-8", "replace"), cut

    def _read_private(self, fd: int) -> bytes:
        """What is in the private output pipe now (every writer is gone), up to max_output_bytes."""
        os.set_blocking(fd, False)
        data = b""
        with contextlib.suppress(BlockingIOError):
            while len(data) <= self.limits.max_output_bytes:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                data += chunk
        return data[:self.limits.max_output_bytes]

    def _kill_leftovers(self, uid: int | None) -> bool:
        """Kill what a run whose supervisor was killed left behind, found by its dedicated uid; False
        when some of it is still there after 5 s."""
        if uid is None:
            return True  # not root: the uid is the caller's own
        # a zombie would take one of the next run's processes
        if left := kill_until_gone(lambda: _processes_of(uid, zombies=True), 5.0, poll_s=0.01):
            logger.warning("sandbox uid %d still has processes %s after 5 s of SIGKILL", uid, sorted(left))
            return False
        return True

    # --- set-up checks -----------------------------------------------------------------------------

    def _probe(self, mode: str, python: _Python) -> SandboxResult:
        with self._dedicated_uid() as uid:
            return self._run("import sys; print(sys.base_prefix); print(sys.base_exec_prefix)", "", uid, mode, python,
                             max(self.limits.wall_s, 10.0), {}, None)

    def _find_python(self, python: str | None, extra_ro_paths: tuple[str, ...]) -> _Python:
        """The first interpreter the sandbox uid can run (a venv under /root, for instance, it cannot)."""
        candidates = [python] if python else [getattr(sys, "_base_executable", sys.executable), sys.executable,
                                              "/usr/bin/python3", shutil.which("python3")]
        tried = []
        for candidate in dict.fromkeys(c for c in candidates if c):
            exe = os.path.realpath(candidate)
            result = self._probe("unsafe-rlimits", _Python(exe))
            if result.ok:
                prefixes = result.stdout.split()
                ro = [*prefixes, str(Path(exe).parent), "/usr/lib", "/usr/lib64", *extra_ro_paths]
                ro = [p for p in dict.fromkeys(os.path.realpath(p) for p in ro) if os.path.exists(p)]
                # a path inside another bound path needs no bind of its own
                ro = [p for p in ro if not any(p != q and _inside(p, q) for q in ro)]
                return _Python(exe, ro)
            tried.append(f"{exe}: {(result.stderr.strip().splitlines() or [f'exit {result.exit_code}'])[-1]}")
        raise RuntimeError("no Python interpreter the sandbox user can run; tried " + "; ".join(tried)
                           + ". Pass python=<path to an interpreter readable by all users>")

    def _choose_mode(self, mode: str) -> str:
        """`mode`, or for auto bwrap, once a probe run works in it; else RuntimeError saying why and what to do."""
        candidate = "bwrap" if mode == "auto" else mode
        why = missing_tool(mode)
        if not why:
            result = self._probe(candidate, self.python)
            if result.ok:
                return candidate
            why = f"{candidate}: {result.stderr.strip()[-300:] or f'exit {result.exit_code}'}"
        raise RuntimeError(f"sandbox mode '{mode}' does not work on this host ({why}): {advice(mode)}")


def missing_tool(mode: str) -> str:
    """Why `mode` cannot run here, as far as a look for its program tells without running it; '' if it is there."""
    tool = {"auto": "bwrap", "bwrap": "bwrap", "unsafe-namespaces": "unshare"}.get(mode)
    return f"'{tool}' is not installed" if tool and not shutil.which(tool) else ""


def advice(mode: str) -> str:
    """What to do when `mode` does not work."""
    return f"{INSTALL}; {OPT_IN}" if mode in ("auto", "bwrap") else "install its program or name another mode"


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _remove_temporary_files_of(uid: int) -> None:
    """What a run of `uid` left directly in the host's shared temporary directories (its own uid owns nothing else
    there). Deeper files, in other users' world-writable directories, would take a walk of the whole tree per run."""
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)


def _private_paths() -> list[str]:
    """What namespaces mode covers with a private tmpfs: the shared temporary directories, the megarl
    checkout (or installation), the caller's working directory and home. Never a directory that holds
    the system itself (the working directory may be /)."""
    system = ("/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin", "/proc", "/dev", "/sys")
    candidates = ["/tmp", "/var/tmp", "/dev/shm", str(Path(__file__).resolve().parents[2]), os.getcwd(),
                  str(Path.home())]
    paths = [os.path.realpath(p) for p in candidates]
    paths = [p for p in dict.fromkeys(paths) if os.path.isdir(p) and not any(_inside(s, p) for s in system)]
    return [p for p in paths if not any(p != q and _inside(p, q) for q in paths)]  # outermost only


def _merged_usr_links() -> list[str]:
    """Recreate /bin, /lib, /lib64, /sbin as the host has them: symlinks into /usr, or read-only binds."""
    args = []
    for top in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top) and top != "/sbin":
            args += ["--ro-bind", top, top]
    return args


def _process_uids(zombies: bool = False):
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited meanwhile
            continue
        if zombies or not status.get("State", "").strip().startswith("Z"):
            yield int(entry.name), int(status["Uid"].split()[0])


def _processes_of(uid: int, zombies: bool = False) -> list[int]:
    """The processes of `uid`; with `zombies`, also those exited and not yet reaped, which hold no memory but still
    count against the uid's RLIMIT_NPROC (a supervisor whose caller died is reaped by init, later)."""
    return [pid for pid, owner in _process_uids(zombies) if owner == uid]


def _count_processes(uid: int) -> int:
    """Processes (with their threads) of `uid`: what RLIMIT_NPROC counts."""
    total = 0
    for pid in _processes_of(uid):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return total
