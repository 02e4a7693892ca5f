"""How a run ends on SIGINT (Ctrl-C) and SIGTERM (`kill`, `timeout`, Slurm, `ray job stop`), and what it says.

  starting (Ray, the workers, a resume, the warm start, the first evaluation): nothing is saved yet, so a signal
      stops the run at once;
  in the step loop (RLTrainer.fit, RMTrainer.fit: `for step in stops.steps(...)`): the first signal lets the step in
      progress finish; the loop saves it when trainer.save_every is on (`stops.requested()` in its save condition)
      and ends; the workers are shut down as at the end of a run. A second signal stops at once.

"At once" is os._exit from the signal handler: no worker is waited for, no exception unwinds through Ray or the
rollout thread. The run's lease (megarl/workers/lease.py) ends every process it started on this node, and Ray ends
a dead driver's actors elsewhere. Either way one line (stderr) says the step reached, the newest checkpoint and
the command that resumes, and the exit status is 128 + the signal: 130 for SIGINT, 143 for SIGTERM. No traceback.

`begin` (python -m megarl.train / train_rm, before Ray starts) installs the handlers and holds the lease
(`reclaim_signals` puts them back on top of Ray's after ray.init); `end` (run_trainer, after the workers are down)
restores the handlers, releases the lease and, after a stop, prints the line and exits. A run that ends on a full disk
(a DiskSpaceError from a checkpoint save: megarl/engine/checkpoint_dir.py) ends the same way, exit status 1: one line with
the directory, the newest complete checkpoint (intact) and the command that resumes, no traceback.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

from megarl.workers import lease

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Run:
    def __init__(self, cfg):
        self.steps, self.save_every = cfg.trainer.steps, cfg.trainer.save_every
        self.resume = cfg.trainer.resume
        self.root = Path(cfg.trainer.checkpoint_dir or Path(cfg.trainer.output_dir) / "checkpoints")
        self.signum: int | None = None  # the first signal received
        self.looping = False  # inside stops.steps: the first signal waits for the step in progress
        self.current: int | None = None  # the step in progress (in stops.steps)
        self.step: int | None = None  # the last step this process completed
        self.answer: bool | None = None  # what requested() said during the step in progress
        self.previous = {}  # the handlers begin() replaced


_run: _Run | None = None


def begin(cfg) -> None:
    """SIGINT and SIGTERM end the run as the module docstring says, from here to `end`; the processes it starts from
    here carry its lease."""
    global _run
    _run = _Run(cfg)
    lease.hold()
    reclaim_signals()


def reclaim_signals() -> None:
    """The handlers on top again once Ray is up: ray.init installs its own for SIGTERM (a sys.exit, then its core
    worker's, which aborts the process)."""
    if _run is None or not _in_main_thread():  # signal.signal works there only: a caller on another keeps its own
        return
    for s in SIGNALS:
        _run.previous.setdefault(s, signal.signal(s, _on_signal))


def end() -> None:
    """The run is over, its workers down: the handlers begin() replaced are back, the lease's leftovers end; after a
    signal, the stop line, and SystemExit with its status (an error in flight, which a signal to the whole process
    group or job brings, e.g. Slurm's SIGTERM to every process, is named in the line instead of a traceback)."""
    global _run
    run, _run = _run, None
    if run is None:
        return
    for s, handler in run.previous.items():  # the run has started: past "while starting"
        signal.signal(s, signal.default_int_handler if handler is stopped_while_starting else handler)
    lease.release()
    error = sys.exc_info()[1]
    if run.signum is None and _disk_full(error):
        at = f"at step {run.current} of {run.steps}" if run.current is not None else "before its first step"
        newest = newest_checkpoint(run.root)
        say(f"megarl: stopped {at}: {error}; {'resume' if newest else 'start again'} once there is room: "
            f"{resume_command(run, newest)}")
        raise SystemExit(1)
    if run.signum is not None:
        failed = f"; the step in progress failed meanwhile ({type(error).__name__}: {first_line(error)})" \
            if isinstance(error, Exception) else ""
        say(stop_line(run, "") + failed)
        raise SystemExit(128 + run.signum)


def steps(first: int, last: int):
    """first..last, one step at a time; after a SIGINT or SIGTERM, the step in progress is the last (the loop's
    save condition asks `requested()`, which decides for the step in progress)."""
    run = _run
    if run is not None:
        run.looping = True
    try:
        for step in range(first, last + 1):
            if run is not None:
                run.current, run.answer = step, None
            yield step
            if run is None:
                continue
            run.step = step
            if run.answer if run.answer is not None else run.signum is not None:
                return
    finally:
        if run is not None:
            run.looping = False


def stopped_while_starting(signum, frame) -> None:
    """An entry point's SIGINT handler until begin(): nothing has started yet (no Ray, no worker), so one line and
    the signal's exit code, not a KeyboardInterrupt traceback from whichever import it lands in."""
    say("megarl: stopped by SIGINT while starting, before any step")
    os._exit(128 + signum)


def requested() -> bool:
    """Whether a SIGINT or SIGTERM asked the run to stop: in stops.steps, the step in progress is then the last (a
    signal after this answer counts for the next step, so that the last step is saved exactly when this said so)."""
    if _run is None:
        return False
    _run.answer = _run.signum is not None
    return _run.answer


def _on_signal(signum, frame) -> None:
    run = _run
    if run is None:  # between end() and the handlers' restoration: nothing of the run is left
        return
    name = signal.Signals(signum).name
    if run.signum is None and run.looping:
        run.signum = signum
        saved = (f"saving it (trainer.save_every={run.save_every})" if run.save_every
                 else "no checkpoint (trainer.save_every=0)")
        say(f"megarl: {name}: finishing step {run.current}, {saved}, then stopping; {name} again stops at once")
        return
    first = run.signum is None
    run.signum = run.signum or signum
    where = "while starting" if first and not run.looping and run.step is None else None
    try:
        say(stop_line(run, f"at once by a second {name}" if not first else "", where))
    finally:
        lease.release(wait=0)  # the reaper ends what this process started, as it exits
        os._exit(128 + run.signum)


def stop_line(run: _Run, how: str, where: str | None = None) -> str:
    """megarl: stopped by SIGINT after step 3 of 50; checkpoint .../step_000003; resume: python -m megarl.train ..."""
    name = signal.Signals(run.signum).name
    if where is None:
        where = (f"after step {run.step} of {run.steps}" if run.step is not None
                 else "before this run completed a step")
        if how and run.looping:
            where += f", abandoning step {run.current}"
    newest = newest_checkpoint(run.root)
    if newest is None:
        saved = "no checkpoint" + (" (trainer.save_every=0)" if not run.save_every else "")
    elif newest[0] == run.step:
        saved = f"checkpoint {newest[1]}"
    else:
        saved = f"newest checkpoint: step {newest[0]}, {newest[1]}" + (
            " (trainer.save_every=0: none written by this run)" if not run.save_every else "")
    again = "resume" if newest is not None else "start again"
    return f"megarl: stopped {how or 'by ' + name} {where}; {saved}; {again}: {resume_command(run, newest)}"


def _disk_full(error: BaseException | None) -> bool:
    """Whether `error` is a checkpoint save's DiskSpaceError."""
    from megarl.engine.checkpoint_dir import DiskSpaceError

    return isinstance(error, DiskSpaceError)


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    from megarl.engine.checkpoint_dir import Checkpoints

    done = Checkpoints(root).complete()
    return done[-1] if done else None


def resume_command(run: _Run, newest) -> str:
    """This process's command line (python -m megarl.train ..., or the console script), with trainer.resume=auto
    (verl's trainer.resume_mode=auto in a command that spells it so) where a checkpoint of this directory exists and
    trainer.resume names something else (none, an initial checkpoint): auto takes the newest one here. Without one,
    the command as it was (an initial checkpoint kept)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        python = "python" if shutil.which("python") == sys.executable else sys.executable
        command = [python, "-m", spec.name.removesuffix(".__main__")]
    else:
        script = os.path.basename(sys.argv[0])
        command = [script if shutil.which(script) == sys.argv[0] else sys.argv[0]]
    args = list(sys.argv[1:])
    if newest is not None and run.resume not in ("auto", "force"):
        verl = ("trainer.resume_mode=", "trainer.resume_from_path=")  # verl's spelling: one of the two, not both
        auto = "trainer.resume_mode=auto" if any(a.startswith(verl) for a in args) else "trainer.resume=auto"
        args = [a for a in args if not a.startswith(("trainer.resume=", *verl))] + [auto]
    return shlex.join(command + args)


def say(line: str) -> None:
    """A line on stderr, written whole: from a signal handler too, where print could re-enter a buffered stream the
    interrupted code was writing."""
    try:
        sys.stdout.flush()
    except (RuntimeError, ValueError, OSError):  # re-entered, closed
        pass
    os.write(2, f"\n{line}\n".encode())


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
