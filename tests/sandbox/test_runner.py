"""The sandbox contains hostile code: these tests check effects on the host (files, connections,
processes, memory obtained), not the messages. They run as root (CI) and as an ordinary user."""

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from megarl.rollout.tools.python_interpreter import PythonInterpreter
from megarl.sandbox.runner import Sandbox, SandboxLimits

AS_ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(wall_s=10.0, memory_mb=256, max_processes=8)  # generous: the test machine may be busy
KILL_AFTER_S = 1.5  # the tests of the wall-clock limit use this one
NAMESPACED = [m for m, tool in (("bwrap", "bwrap"), ("unsafe-namespaces", "unshare")) if shutil.which(tool)]


@pytest.fixture(scope="module", params=NAMESPACED + ["unsafe-rlimits"])
def sandbox(request):
    box = Sandbox(LIMITS, mode=request.param, slots=3)
    yield box
    box.close()


@pytest.fixture(scope="module")
def bwrap_sandbox():
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    box = Sandbox(LIMITS, mode="bwrap")
    yield box
    box.close()


def sandbox_processes() -> list[int]:
    """Python processes running a sandbox script (argv ends with `main.py <32-hex run id>`), zombies aside."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
                state = next(line for line in Path(f"/proc/{entry.name}/status").read_text().splitlines()
                             if line.startswith("State:"))
            except (OSError, StopIteration):
                continue
            if os.path.basename(argv[0]).startswith(b"python") and b"main.py" in argv and re.fullmatch(rb"[0-9a-f]{32}", argv[-2] if argv[-1] == b"" else argv[-1]) \
                    and "Z" not in state:
                pids.append(int(entry.name))
    return pids


def fork_budget(box) -> int:
    """Processes a run may start: none where no memory cgroup bounds them together."""
    return LIMITS.max_processes if box.memory_bound == "cgroup" else 0


def assert_still_works(box):
    result = box.run("print(6 * 7)")
    assert result.ok and result.stdout == "42\n"


@pytest.fixture
def host_dir():
    """A world-writable directory with world-readable files: only the sandbox's isolation protects it."""
    path = Path(tempfile.mkdtemp(prefix="megarl-host-"))
    path.chmod(0o777)
    (path / "secret.txt").write_text("SECRET-" + uuid.uuid4().hex)
    (path / "canary.txt").write_text("original")
    for f in path.iterdir():
        f.chmod(0o666)
    yield path
    shutil.rmtree(path)


def test_files_outside_cannot_be_read_or_written(bwrap_sandbox, host_dir):
    secret, canary = host_dir / "secret.txt", host_dir / "canary.txt"
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in host_dir.iterdir()}
    marker = f"megarl-escape-{uuid.uuid4().hex}"
    code = f"""
import ctypes, importlib
attempts = {{
    "read": lambda: open({str(secret)!r}).read(),
    "read via /proc/self/root": lambda: open("/proc/self/root" + {str(secret)!r}).read(),
    "read via /proc/1/root": lambda: open("/proc/1/root" + {str(secret)!r}).read(),
    "write new": lambda: open({str(host_dir / "new.txt")!r}, "w").write("x"),
    "overwrite": lambda: open({str(canary)!r}, "w").write("changed"),
    "write via /proc/self/root": lambda: open("/proc/self/root" + {str(host_dir / "new2.txt")!r}, "w").write("x"),
    "ctypes creat": lambda: ctypes.CDLL(None).creat({str(host_dir / "new3.txt").encode()!r}, 0o644),
    "import built at run time": lambda: getattr(importlib.import_module("o" + "s"), "sys" + "tem")(
        "echo pwned > {host_dir}/new4.txt; cat {secret}; echo x > /tmp/{marker}; echo x > /dev/shm/{marker}"),
    "host /tmp": lambda: open("/tmp/{marker}-2", "w").write("x"),
    "host /dev/shm": lambda: open("/dev/shm/{marker}-2", "w").write("x"),
}}
for name, attempt in attempts.items():
    try:
        print(name, "->", attempt())
    except Exception as e:
        print(name, "-> failed:", type(e).__name__)
"""
    result = bwrap_sandbox.run(code)
    assert result.exit_code == 0, result.stderr  # the attempts ran (and failed or went elsewhere)
    assert secret.read_text() not in result.stdout + result.stderr
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in host_dir.iterdir()}
    assert after == before  # nothing created, nothing changed
    for leftover in (f"/tmp/{marker}", f"/dev/shm/{marker}", f"/tmp/{marker}-2", f"/dev/shm/{marker}-2"):
        assert not os.path.exists(leftover)
    assert_still_works(bwrap_sandbox)


def test_only_the_python_runtime_is_visible_read_only(bwrap_sandbox):
    code = """
import os
print(sorted(os.listdir("/")))
print(os.listdir("/var"))
for path in ("/usr/x", "/sandbox/x", "/tmp/x", "/var/tmp/x"):
    try:
        open(path, "w").write("x"); print(path, "writable")
    except OSError as e:
        print(path, "denied")
"""
    result = bwrap_sandbox.run(code)
    lines = result.stdout.splitlines()
    assert not {"etc", "root", "home", "work"} & set(eval(lines[0])) and lines[1] == "['tmp']"
    assert lines[2:] == ["/usr/x denied", "/sandbox/x writable", "/tmp/x writable", "/var/tmp/x writable"]


@pytest.mark.parametrize("mode", NAMESPACED)
def test_no_connection_reaches_the_host(mode):
    box = Sandbox(LIMITS, mode=mode)
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    udp.setblocking(False)
    host_ips = {"127.0.0.1"}
    try:  # the host's own addresses as well, where its name resolves
        host_ips |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    code = f"""
import socket
for ip in {sorted(host_ips)!r}:
    try:
        s = socket.create_connection((ip, {server.getsockname()[1]}), timeout=1); print(ip, "connected")
    except OSError as e:
        print(ip, "failed", e.errno)
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", (ip, {udp.getsockname()[1]}))
    except OSError as e:
        print(ip, "udp failed", e.errno)
"""
    try:
        result = box.run(code)
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection was ever made
        with pytest.raises(BlockingIOError):
            udp.recvfrom(16)  # no datagram arrived
        assert "connected" not in result.stdout and result.exit_code == 0
        assert_still_works(box)
    finally:
        server.close()
        udp.close()
        box.close()


def test_fork_bomb_is_capped_and_leaves_nothing_behind(sandbox):
    counts = []
    done = threading.Event()

    def watch():  # until shortly before the kill: while dying processes are replaced, more can show
        while not done.wait(0.02) and time.monotonic() < start + KILL_AFTER_S - 0.3:
            counts.append(len(sandbox_processes()))

    start = time.monotonic()
    watcher = threading.Thread(target=watch)
    watcher.start()
    result = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                         wall_s=KILL_AFTER_S)
    done.set()
    watcher.join()
    assert result.timed_out and time.monotonic() - start < KILL_AFTER_S + 10  # the kill itself, on a loaded 2-core machine
    assert 1 + (fork_budget(sandbox) > 0) <= max(counts) <= 1 + fork_budget(sandbox)  # forked only up to the budget
    assert sandbox_processes() == []  # every process of the run is gone
    assert_still_works(sandbox)


def test_a_daemonised_child_does_not_outlive_the_run(sandbox):
    if not fork_budget(sandbox):
        pytest.skip("without a memory cgroup a run may not fork")
    if sandbox.mode == "unsafe-rlimits" and not AS_ROOT:
        pytest.skip("documented gap: without namespaces or root, a child that leaves the process group survives")
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n"
    result = sandbox.run(code)
    assert result.ok and result.stdout == "parent done\n" and result.seconds < 5  # did not wait for the child
    deadline = time.monotonic() + 2
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_memory_is_capped(sandbox):
    code = """
blocks = []
try:
    while True:
        blocks.append(bytearray(8 << 20))  # zero-filled: touched
except MemoryError:
    pass
print(len(blocks) * 8)
"""
    result = sandbox.run(code)
    obtained_mb = int(result.stdout)
    assert LIMITS.memory_mb // 2 < obtained_mb < LIMITS.memory_mb  # the cap stopped it, near the cap
    assert_still_works(sandbox)


def test_an_endless_loop_is_killed_at_the_wall_clock_limit(sandbox):
    start = time.monotonic()
    result = sandbox.run("while True:\n    pass\n", wall_s=KILL_AFTER_S)
    elapsed = time.monotonic() - start
    assert result.timed_out and KILL_AFTER_S <= elapsed < KILL_AFTER_S + 10
    assert sandbox_processes() == []
    assert_still_works(sandbox)


def test_output_is_bounded(sandbox):
    result = sandbox.run("while True:\n    print('x' * 1000)\n", wall_s=KILL_AFTER_S)
    assert len(result.stdout) == LIMITS.max_output_bytes and result.output_truncated and not result.ok



def test_a_run_ends_with_its_caller(sandbox):
    """A caller killed mid-run (a reward process, when its run's driver was SIGKILLed: megarl/workers/lease.py): the
    supervisor ends the code at once, not at the wall-clock limit."""
    before = set(sandbox_processes())
    caller = subprocess.Popen([sys.executable, "-c", "from megarl.sandbox.runner import Sandbox, SandboxLimits; "
                               f"Sandbox(SandboxLimits(wall_s=120.0, memory_mb=256), mode={sandbox.mode!r})"
                               ".run('import time; time.sleep(120)')"])
    deadline = time.monotonic() + 60
    while not set(sandbox_processes()) - before:  # the code runs
        assert caller.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10  # a loaded 2-core machine; the limit is 120 s
    while set(sandbox_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(sandbox_processes()) - before

@pytest.mark.skipif(not AS_ROOT, reason="separate process budgets need a uid per run, which only root can assign")
def test_concurrent_runs_each_get_their_own_process_budget(sandbox):
    if not fork_budget(sandbox):
        pytest.skip("without a memory cgroup a run may not fork")
    code = ("import os, time\nn = 0\nfor _ in range(%d):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(1); os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
            "print(n)\n") % (LIMITS.max_processes + 4)
    results = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, sandbox.run(code))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [int(r.stdout) for r in results] == [LIMITS.max_processes] * 3


def test_python_tool_reports_violations_and_carries_on():
    tool = PythonInterpreter(timeout_s=2.0, memory_mb=256)
    try:
        assert tool.run("print(sum(range(10)))") == "45\n"
        for code, expected in (("while True: pass", "ran longer than 2 s"),
                               ("x = bytearray(1 << 34)", "MemoryError"),
                               ("import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)", "exit status")):
            with pytest.raises(Exception, match=expected):
                tool.run(code)
        assert tool.run("print('still here')") == "still here\n"
    finally:
        tool.close()


def test_the_sandbox_work_directory_is_private_and_removed():
    box = Sandbox(LIMITS, mode="unsafe-rlimits")
    try:
        result = box.run("import os; open('f', 'w').write('x'); print(os.getcwd())")
        assert not os.path.exists(result.stdout.strip())  # removed after the run
        assert stat.S_IMODE(box.root.stat().st_mode) == 0o711  # others cannot list the runs
    finally:
        box.close()
    assert not box.root.exists()


@pytest.mark.skipif(not AS_ROOT, reason="dedicated uids need root")
def test_a_uid_left_with_unkillable_processes_is_not_used_again(monkeypatch):
    """Zombies under an init that does not reap survive SIGKILL and would count against the next
    run's process limit: such a uid is skipped, once looked at, for the rest of the sandbox's life."""
    box = Sandbox(LIMITS, mode="unsafe-rlimits", uid_base=1_600_000)
    looked_at = []

    def kill_leftovers(uid):
        looked_at.append(uid)
        return uid != 1_600_000  # the first uid "keeps" its leftovers

    monkeypatch.setattr(box, "_kill_leftovers", kill_leftovers)
    try:
        for _ in range(2):
            result = box.run("import os; print(os.getuid())")
            assert result.ok and result.stdout == "1600001\n"
        assert looked_at.count(1_600_000) == 1
    finally:
        box.close()


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += int(next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), 0))
    return total / 1024


def test_the_run_as_a_whole_stays_within_its_memory(sandbox):
    """Children that each fill part of the budget cannot add up to more than it (a cgroup holds them
    together, or no child can start at all)."""
    code = """
import os, time
for _ in range(6):
    try:
        if os.fork() == 0:
            block = b"x" * (120 << 20)  # written: resident
            time.sleep(2.5)
            os._exit(0)
    except OSError:
        break
time.sleep(2.5)
"""
    peak, done = [0.0], threading.Event()

    def watch():
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss_mb(sandbox_processes()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        sandbox.run(code)
    finally:
        done.set()
        watcher.join()
    # 6 x 120 MiB without a bound; resident pages shared after fork count once per process here
    assert peak[0] < 1.5 * LIMITS.memory_mb
    assert_still_works(sandbox)


def test_without_a_memory_cgroup_a_run_is_one_process(monkeypatch, caplog):
    from megarl.sandbox import runner

    monkeypatch.setattr(runner.MemoryCgroups, "find", classmethod(lambda cls: (None, "not delegated here")))
    with caplog.at_level("WARNING", logger=runner.__name__):
        box = Sandbox(LIMITS, mode=NAMESPACED[0] if NAMESPACED else "unsafe-rlimits")
    try:
        assert "no further process or thread per run (no memory cgroup: not delegated here)" in caplog.text
        result = box.run("import os, threading\ntry:\n    os.fork()\nexcept OSError:\n    print('no fork')\n"
                         "try:\n    threading.Thread(target=print).start()\nexcept RuntimeError:\n    print('no thread')\n")
        assert result.stdout == "no fork\nno thread\n"
    finally:
        box.close()
