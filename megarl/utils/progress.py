"""Progress of the phases that take a while, with their totals and ETAs.

On a terminal a phase of counted steps is a tqdm bar (its total, rate and ETA; the current stage of an RL step as
its postfix); where stdout is not a terminal (a log file, CI, a run under `ray job submit`) there is no bar, and a
phase prints one plain line per interval instead. A phase that is one opaque call (building the workers, an
evaluation, a checkpoint write, an export) prints a line as it starts, with the time it took last time as its ETA,
and one when it ends.

    with Progress("SFT warm start", total=200, every_s=PLAIN_EVERY_S) as bar:
        for step in range(1, 201):
            ...; bar.set(step)
    with phases("writing checkpoint step 20", kind="checkpoint write"):  # the module's Phases
        ...

The console's step lines (`step 3/120 | reward 0.51 | ... | ETA 04:10`, megarl/utils/tracking.py) take their total
and ETA from the Progress that a Tracker follows.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

from tqdm import tqdm

PLAIN_EVERY_S = 30.0  # without a terminal, a phase's progress line at most this often (and at its end)


def on_terminal() -> bool:
    """Whether stdout is a terminal that a bar can redraw in place."""
    return sys.stdout.isatty()


def duration(seconds: float) -> str:
    """Seconds as a bar shows them: 05:07, or 1:02:03."""
    return tqdm.format_interval(max(0.0, seconds))


def write(line: str) -> None:
    """A line on stdout, printed above any bar that is showing (a plain print would split the bar)."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


class Progress:
    """`total` counted steps of a phase, `done` of them finished before it started (a resumed run's).

    every_s: without a terminal, print `<desc>: N/T <unit>, MM:SS elapsed, ETA MM:SS` when this many seconds have
    passed since the last such line, and at the end; None: no lines of its own (the console's step lines say it).
    terminal: draw a bar (default: whether stdout is a terminal)."""

    def __init__(self, desc: str, total: int, unit: str = "step", done: int = 0, label: str = "step",
                 every_s: float | None = PLAIN_EVERY_S, terminal: bool | None = None):
        self.desc, self.total, self.unit, self.label, self.every_s = desc, total, unit, label, every_s
        self.n = self.first = done
        self.start = self.last_line = time.monotonic()
        self.terminal = on_terminal() if terminal is None else terminal
        self.bar = (tqdm(total=total, initial=done, desc=desc, unit=unit, file=sys.stdout, dynamic_ncols=True)
                    if self.terminal else None)

    def set(self, n: int) -> None:
        """`n` of the total done (never backwards)."""
        if n <= self.n:
            return
        if self.bar is not None:
            self.bar.update(n - self.n)
        self.n = n
        now = time.monotonic()
        if self.bar is None and self.every_s is not None and (now - self.last_line >= self.every_s
                                                              or n == self.total):
            self.last_line = now
            write(self.plain_line())

    def update(self, n: int = 1) -> None:
        self.set(self.n + n)

    def stage(self, name: str) -> None:
        """What the current step is doing (generate, reward, train, sync ...): the bar's postfix."""
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=True)

    def eta(self) -> float | None:
        """Seconds left at this phase's mean pace so far; None before its first step ends."""
        finished = self.n - self.first
        if finished <= 0:
            return None
        return (time.monotonic() - self.start) / finished * (self.total - self.n)

    def position(self) -> str:
        """`<label> N/T`, e.g. `step 3/120`."""
        return f"{self.label} {self.n}/{self.total}"

    def plain_line(self) -> str:
        eta = self.eta()
        return (f"{self.desc}: {self.n}/{self.total} {self.unit}s, {duration(time.monotonic() - self.start)} "
                f"elapsed" + (f", ETA {duration(eta)}" if eta is not None and self.n < self.total else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Phases:
    """Opaque phases, each a line as it starts and one as it ends. One of a `kind` that repeats (evaluation,
    checkpoint write) gives the last one's duration as its ETA."""

    def __init__(self):
        self.last: dict[str, float] = {}

    @contextmanager
    def __call__(self, what: str, kind: str | None = None) -> Iterator[None]:
        known = self.last.get(kind) if kind else None
        write(f"{what} ..." + (f" (ETA {duration(known)}, as the last {kind})" if known is not None else ""))
        start = time.monotonic()
        yield
        seconds = time.monotonic() - start
        if kind:
            self.last[kind] = seconds
        write(f"{what}: done in {duration(seconds)}")


phases = Phases()  # the process's: one console
