"""SIGINT and SIGTERM end a run cleanly, and a driver that dies leaves no process behind (megarl/stops.py,
megarl/workers/lease.py): tiny CPU runs of `python -m megarl.train` in subprocesses, each with a local Ray of its
own. A run's processes are found as its reaper finds them: below its driver (recorded while the driver lives) and by
a marker this test puts in the driver's environment, which they inherit.
"""

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import QUICKSTART

ROOT = QUICKSTART.parent.parent
STEPS = 50
TINY = ["trainer.steps=50", "sft.steps=2", "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8",
        "rollout.eval_n_samples=1", "actor.parallel.world_size=1", "actor.parallel.tp=1", "model.tiny_num_layers=1",
        "trainer.loggers=[console,jsonl]", "trainer.ray_address=local"]  # never a cluster another run left
MARK = "MEGARL_TEST_STOPS"
START_S = 300  # to the first step on 2 loaded cores (~60 s alone)

# A reward that answers `STOPS_HANG_AFTER` calls (the held-out evaluation's), then hangs in the next, inside a
# step: its reward process sleeps, as a reward stuck in C would, and the driver waits for it.
HANGING_REWARD = '''
import os, time

calls = 0


def reward(response, answer, sample):
    global calls
    calls += 1
    if calls > int(os.environ["STOPS_HANG_AFTER"]):
        open(os.environ["STOPS_HANG_FILE"], "w").close()
        time.sleep(3600)
    return 0.0
'''


class Run:
    """A driver subprocess; its stdout and stderr lines collected as they come."""

    started: list["Run"] = []

    def __init__(self, argv: list[str], cwd: Path = ROOT, env: dict | None = None, own_group: bool = False):
        """own_group: the driver leads a process group (and session) of its own, as under `timeout` or a shell's
        job control, so that a test can signal the whole group as they do."""
        self.started.append(self)
        self.mark = uuid.uuid4().hex
        self.seen: set[tuple[int, float]] = set()  # (pid, start time) of the processes found below the driver
        self.out, self.err, self.changed = [], [], threading.Condition()
        self.process = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {}), MARK: self.mark},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=own_group)
        for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, lines), daemon=True).start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self.changed:
                lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, lines: list[str], timeout: float = START_S) -> re.Match:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in lines:
                    if found := re.search(pattern, line):
                        return found
                assert self.process.poll() is None, f"the run ended ({self.process.returncode}):\n{self.log()}"
                assert time.monotonic() < deadline, f"no line matching {pattern!r} in {timeout} s:\n{self.log()}"
                self.changed.wait(1.0)

    def exit_code(self, timeout: float = 180) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"still running {timeout} s after the signal:\n{self.log()}") from None

    def stop_line(self) -> str:
        with self.changed:
            stops = [line for line in self.err if line.startswith("megarl: stopped")]
        assert len(stops) == 1, self.log()
        assert not any("Traceback" in line for line in self.err), self.log()
        return stops[0]

    def log(self) -> str:
        with self.changed:
            return "\n".join(self.out[-30:] + ["--- stderr ---"] + self.err[-40:])

    def processes(self) -> dict[int, str]:
        """The run's live processes, by pid: those descending from its driver (recorded while it lives: its death
        orphans them to init) and those carrying the marker in their environment (which a process that sets its
        title may overwrite: Ray's agents do)."""
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen |= {(p.pid, p.create_time()) for p in psutil.Process(self.process.pid).children(True)}
        found = {}
        for p in psutil.process_iter(["create_time", "status", "cmdline"]):
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with contextlib.suppress(psutil.Error):
                if (p.pid, p.info["create_time"]) in self.seen or p.environ().get(MARK) == self.mark:
                    found[p.pid] = " ".join(p.info["cmdline"] or [])
        return found

    def left_after(self, seconds: float) -> dict[int, str]:
        """The marked processes still alive `seconds` after now (at once when none are)."""
        deadline = time.monotonic() + seconds
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:  # leave nothing behind for the next test, whatever this one asserts
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def train(output_dir: Path, *overrides: str, env: dict | None = None) -> Run:
    return Run([sys.executable, "-m", "megarl.train", "--config", str(QUICKSTART), *TINY,
                "trainer.save_every=1", f"trainer.output_dir={output_dir}", *overrides], env=env)


@pytest.fixture(scope="module", autouse=True)
def _nothing_left():
    """Whatever a test asserts, no driver or process of its runs outlives the module."""
    yield
    for run in Run.started:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
        run.left_after(10)


@pytest.fixture(scope="module")
def hanging_runs(tmp_path_factory) -> dict[str, tuple[Run, Path]]:
    """Two runs whose reward hangs in step 1 (one to interrupt twice, one to kill), each with the file its reward
    writes then; the second starts once the first's Ray is up (two Rays starting at once beside other work timed
    out on 2 busy cores), and they get to the hang side by side."""
    root = tmp_path_factory.mktemp("hanging")
    (root / "hanging_reward.py").write_text(HANGING_REWARD)
    runs = {}
    for name in ("interrupted", "killed"):
        hang = root / f"{name}.hanging"
        env = {"STOPS_HANG_AFTER": "8", "STOPS_HANG_FILE": str(hang)}  # 8: data.val_size x eval_n_samples
        run = train(root / name, f"reward.name={root / 'hanging_reward.py'}:reward", "reward.timeout_s=0", env=env)
        run.wait_for(r"^megarl: world_size=", run.out)
        runs[name] = run, hang
    return runs


def wait_file(run: Run, path: Path, timeout: float = START_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert run.process.poll() is None and time.monotonic() < deadline, run.log()
        time.sleep(0.2)


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:  # ended meanwhile
        return None


def checkpoint(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step:08d}"


def test_sigint_then_sigterm_stop_after_the_step_save_it_and_say_how_to_resume(tmp_path):
    """Ctrl-C after a step: that step (or the next, in progress) finishes and is saved; one line names it and the
    command; exit 130. That command resumes after it; SIGTERM there, to the driver's whole process group as `timeout`
    sends it: the same, exit 143 (the local Ray's processes are in sessions of their own: the signal does not end
    Ray's GCS under the driver). Nothing is left running."""
    out = tmp_path / "run"
    run = train(out)
    run.wait_for(r"^step 1(/\d+)? \| reward", run.out)  # "step 1/50": with the run's total
    assert "ray::RolloutWorker" in " ".join(run.processes().values())  # recorded: left_after checks them too
    run.process.send_signal(signal.SIGINT)
    run.wait_for(r"^megarl: SIGINT: finishing step \d+, saving it", run.err, timeout=60)
    assert run.exit_code() == 130
    line = run.stop_line()
    step = int(re.search(rf"^megarl: stopped by SIGINT after step (\d+) of {STEPS}; checkpoint \S+; resume: ",
                         line).group(1))
    assert f"checkpoint {checkpoint(out, step)};" in line and (checkpoint(out, step) / "checkpoint.json").is_file()
    assert not run.left_after(10)

    command = shlex.split(line.split("; resume: ", 1)[1])
    assert command[1:] == ["-m", "megarl.train", *run.process.args[3:]]  # the same command line
    resumed = Run([sys.executable, *command[1:]], own_group=True)
    resumed.wait_for(rf"^resumed from {re.escape(str(checkpoint(out, step)))} after step {step}$", resumed.out)
    resumed.wait_for(rf"^step {step + 1}(/\d+)? \| reward", resumed.out)
    started = resumed.processes()
    assert "ray::RolloutWorker" in " ".join(started.values())
    in_group = {pid: line for pid, line in started.items() if process_group(pid) == resumed.process.pid}
    assert list(in_group) == [resumed.process.pid], in_group  # Ray's processes have sessions of their own
    os.killpg(resumed.process.pid, signal.SIGTERM)
    assert resumed.exit_code() == 143
    assert not any("GCS" in line for line in resumed.err), resumed.log()
    line = resumed.stop_line()
    later = int(re.search(rf"^megarl: stopped by SIGTERM after step (\d+) of {STEPS}; checkpoint ", line).group(1))
    assert later > step and (checkpoint(out, later) / "checkpoint.json").is_file()
    assert not resumed.left_after(10)


def test_a_second_sigint_stops_at_once_and_ends_every_process(hanging_runs):
    """The step cannot finish (its reward hangs): the first SIGINT waits for it, the second ends the run at once,
    still with one line, exit 130, and no process of the run left."""
    run, hang = hanging_runs["interrupted"]
    wait_file(run, hang)
    assert "ray::RolloutWorker" in " ".join(run.processes().values())
    run.process.send_signal(signal.SIGINT)
    run.wait_for(r"^megarl: SIGINT: finishing step 1, saving it", run.err, timeout=60)
    run.process.send_signal(signal.SIGINT)
    assert run.exit_code(timeout=30) == 130
    line = run.stop_line()
    assert line.startswith("megarl: stopped at once by a second SIGINT before this run completed a step, "
                           "abandoning step 1; no checkpoint; start again: "), line
    assert not checkpoint(hang.parent / "interrupted", 1).exists()
    assert not run.left_after(10)


def test_a_killed_driver_leaves_no_process_behind(hanging_runs):
    """SIGKILL of the driver while a reward call hangs: every process it started (Ray's own, the training rank, the
    rollout actor, the reward process) ends within 10 s."""
    run, hang = hanging_runs["killed"]
    wait_file(run, hang)
    started = " | ".join(run.processes().values())
    for kind in ("raylet", "ray::DashboardAgent", "ray::TrainWorker", "ray::RolloutWorker", "megarl.rewards.worker"):
        assert kind in started, started
    run.process.kill()
    run.process.wait()
    left = run.left_after(10)
    assert not left, f"alive 10 s after the driver's SIGKILL: {left}"


def test_ctrl_c_while_starting_ends_with_one_line_and_no_traceback(tmp_path):
    """Ctrl-C while the driver still prepares the run (here: importing a reward module that takes its time, as one
    importing a large library does), before megarl/stops.py's handlers: one line, exit 130, no KeyboardInterrupt
    traceback, nothing left running."""
    imported = tmp_path / "imported"
    (tmp_path / "slow_import.py").write_text(f"import pathlib, time\npathlib.Path({str(imported)!r}).touch()\n"
                                             "time.sleep(120)\n\ndef reward(response, answer, sample):\n    return 0.0\n")
    run = train(tmp_path / "run", f"reward.name={tmp_path / 'slow_import.py'}:reward")
    wait_file(run, imported)
    run.process.send_signal(signal.SIGINT)
    assert run.exit_code(timeout=60) == 130, run.log()
    assert run.stop_line() == "megarl: stopped by SIGINT while starting, before any step", run.log()
    assert not run.left_after(10)
