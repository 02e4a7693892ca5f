"""Programs that try to score without solving the task, run through the real sandbox in every mode
the host offers: each must score 0.0, while a correct solution scores 1.0."""

import dataclasses
import hashlib
import json
import re
import shutil

import pytest

from megarl.rewards.code import CodeReward

ADD_TESTS = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]})
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"
MODES = [pytest.param(mode, marks=pytest.mark.skipif(not shutil.which(tool), reason=f"'{tool}' is not installed"))
         for mode, tool in (("bwrap", "bwrap"), ("unsafe-namespaces", "unshare"), ("unsafe-rlimits", "python3"))]

# Each is a wrong solution plus a trick that made the old reward (program + asserts, exit status 0 =
# success) pay, or that tries to reach the harness's verdict.
HOSTILE = {
    "early os._exit(0)": WRONG + "import os\nos._exit(0)\n",
    "atexit registers os._exit(0)": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG,
    "sys.exit(0) in a finally": WRONG + "import sys\ntry:\n    pass\nfinally:\n    sys.exit(0)\n",
    "excepthook exits 0": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n" + WRONG,
    "a timer signal exits 0 mid-test": (
        "import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
        "def add(a, b):\n    signal.setitimer(signal.ITIMER_REAL, 0.05)\n    time.sleep(5)\n"),
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + WRONG,
    "__eq__ always true": (
        "class Yes:\n    __eq__ = __ne__ = lambda self, other: True\n    __bool__ = lambda self: True\n"
        "def add(a, b):\n    return Yes()\n"),
    "int subclass equal to everything": (
        "class Int(int):\n    __eq__ = lambda self, other: True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Int(0)\n"),
    "tampers with the harness in its own process": (
        "import sys\nfor module in list(sys.modules.values()):\n    if hasattr(module, 'encode'):\n"
        "        module.encode = lambda *a, **k: 3\n" + WRONG),
    "reads the expected value from its caller's source line": (
        "import re, sys\ndef add(a, b):\n    frame = sys._getframe(1)\n    try:\n"
        "        line = open(frame.f_code.co_filename).read().splitlines()[frame.f_lineno - 1]\n"
        "    except Exception:\n        line = ''\n    match = re.search(r'==\\s*(-?\\d+)', line)\n"
        "    return int(match.group(1)) if match else 0\n"),
    "prints a verdict of its own": (
        "import json, os\n" + WRONG + "print(json.dumps({'secret': '0' * 64, 'total': 2, 'passed': 2, 'failure': ''}))\n"
        "os._exit(0)\n"),
}


@pytest.fixture(scope="module", params=MODES)
def reward(request):
    reward = CodeReward(timeout_s=10.0, memory_mb=256, slots=2, mode=request.param)
    yield reward
    reward.close()


def score(reward, program, answer=ADD_TESTS):
    return reward(f"```python\n{program}```", answer, {})


def test_a_correct_solution_still_scores(reward):
    assert score(reward, CORRECT) == 1.0
    methods = json.dumps({"asserts": ["assert Solution().pair(2, [1.5]) == (2, [1.5], {'k': b'v'}, {None})",
                                      "assert math.isclose(Solution().half(3), 1.5)"]})
    program = ("import math\nclass Solution:\n    def pair(self, a, b):\n        return (a, b, {'k': b'v'}, {None})\n"
               "    def half(self, x):\n        return x / 2\n")
    assert score(reward, program, methods) == 1.0


# a test that expects an exception, as APPS and verl write them: a raise the program's code makes reaches it as the
# builtin class it derives from
RAISES = json.dumps({"asserts": [
    "assert root(9) == 3",
    "try:\n    root(-1)\nexcept ValueError as e:\n    assert str(e) == 'NegativeError: no root of -1'\n"
    "else:\n    raise AssertionError('root(-1) did not raise')",
    "try:\n    root('x')\n    assert False, 'no TypeError'\nexcept TypeError:\n    pass"]})
ROOT = ("class NegativeError(ValueError):\n    pass\n"
        "def root(n):\n    if not isinstance(n, int):\n        raise TypeError(n)\n"
        "    if n < 0:\n        raise NegativeError(f'no root of {n}')\n    return round(n ** 0.5)\n")


def test_a_test_may_expect_an_exception(reward):
    assert score(reward, ROOT, RAISES) == 1.0
    for wrong in ("def root(n):\n    return round(abs(n) ** 0.5) if isinstance(n, int) else 0\n",  # no raise
                  ROOT.replace("raise NegativeError", "raise KeyError"),  # the wrong exception
                  ROOT.replace("raise NegativeError(f'no root of {n}')", "raise SystemExit(0)"),  # no Exception
                  ROOT.replace("raise TypeError(n)", "import os; os._exit(0)")):  # ends instead
        assert score(reward, wrong, RAISES) == 0.0


@pytest.mark.parametrize("trick", sorted(HOSTILE))
def test_hostile_program_scores_zero(reward, trick):
    assert score(reward, HOSTILE[trick]) == 0.0


def test_early_exit_fails_stdin_tests(reward):
    answer = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    assert score(reward, "import os\nos._exit(0)\n", answer) == 0.0
    assert score(reward, "a, b = map(int, input().split())\nprint(a + b)\n", answer) == 1.0


# {target}: the sha256 of the secret the test plants: the program compares every candidate it finds with it
# and prints one verdict line (a list of every 64-digit hex string on the host would overflow the run's output)
SEARCH = r"""
import gc, hashlib, os, re, sys
TARGET = "{target}"
found, read = set(), []
def look(data):
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    found.update(m.decode() for m in re.findall(rb"[0-9a-f]{64}", data))
def try_read(path):
    try:  # not blocking: among its own descriptors are pipes
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            data = f.read(1 << 20)
        read.append(path)
        look(data)
    except Exception:
        pass
look(open(__file__ if "__file__" in globals() else "program.py").read() if os.path.exists("program.py") else "")
for top in (".", "/tmp", "/sandbox", "/dev/shm", "/var/tmp"):
    # at most 2000 files a directory tree: rlimits mode sees the host's /tmp, which a test run fills (pytest's
    # own directories), and the search must end within the run's time limit to show it found nothing
    walked = (os.path.join(d, name) for d, _, files in os.walk(top) for name in files)
    for path, _ in zip(walked, range(2000)):
        try_read(path)
pids = ["self", str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    for name in ("cmdline", "environ", "maps", "stat", "status", "comm"):
        try_read(f"/proc/{pid}/{name}")
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try_read(f"/proc/{pid}/fd/{fd}")
    except Exception:
        pass
    try:  # the process's memory, region by region
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
            for line in maps:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if "r" in line.split()[1] and end - start < (64 << 20):
                    try:
                        mem.seek(start); look(mem.read(end - start))
                    except Exception:
                        pass
        read.append(f"/proc/{pid}/mem")
    except Exception:
        pass
for fd in range(3, 64):
    try:
        look(os.pread(fd, 1 << 20, 0))
    except Exception:
        pass
for obj in gc.get_objects():
    look(repr(obj)[:10000])
frame = sys._getframe()
while frame:
    look(repr(frame.f_locals)[:100000]); frame = frame.f_back
hit = any(hashlib.sha256(c.encode()).hexdigest() == TARGET for c in found)
print("SECRET FOUND" if hit else f"secret not among {len(found)} candidates")
print("read", len(read), "files, of them", " ".join(p for p in read if p.startswith("/proc/self/")))
"""


def test_the_secret_cannot_be_found(reward, monkeypatch):
    """The program searches its source, files, /proc (its own, its parent's, every visible process's
    memory and descriptors), inherited descriptors and its own memory for the per-run secret."""
    from megarl.sandbox import harness

    secret = "5ec2e7" * 10 + "abcd"
    monkeypatch.setattr(harness, "new_secret", lambda: secret)
    # the search reads every visible process's memory (rlimits mode sees the host's): its time grows with what else
    # runs there (once, in the full suite, it printed nothing: killed at the 10 s limit), not with what is tested
    monkeypatch.setattr(reward.sandbox, "limits", dataclasses.replace(reward.sandbox.limits, wall_s=60.0))
    search = SEARCH.replace("{target}", hashlib.sha256(secret.encode()).hexdigest())
    report = harness.run_function_tests(reward.sandbox, search + WRONG, ["assert add(1, 2) == 3"])
    output = report.run.stdout + report.run.stderr
    assert re.search(r"^read .*/proc/self/cmdline", output, re.M), output[-2000:]  # the search ran to its end
    assert "secret not among" in output and "SECRET FOUND" not in output and secret not in output
    assert not report.ok and report.failure.startswith("test 0: AssertionError")
