"""Wall-clock timing of the phases of a step: `with timers("generate"): ...`, then `timers.pop()`."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator


class Timers:
    """Accumulates wall time per name until `pop`. Wall time is what the driver waits for: remote work
    (Ray calls, GPU kernels) counts only once the timed block waits for its result."""

    def __init__(self, origin: float | None = None, on_start: Callable[[str], None] | None = None):
        """origin: a time.perf_counter() reading; given, pop() also returns when each phase first started and last
        ended, in seconds since it ('phase/<name>/start', 'phase/<name>/end'), for a timeline of what overlapped
        (the asynchronous modes: timers of different threads given the same origin). on_start: called with each
        phase's name as it starts (the progress bar shows the stage a step is in: Tracker.stage)."""
        self.on_start = on_start
        self._seconds: dict[str, float] = defaultdict(float)
        self.origin = origin
        self._spans: dict[str, list[float]] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_start is not None:
            self.on_start(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._seconds[name] += end - start
            self._spans.setdefault(name, [start, end])[1] = end

    def pop(self) -> dict[str, float]:
        """{'timing/<name>': seconds} accumulated since the last pop (and the phases' spans, with an origin);
        resets them."""
        out = {f"timing/{name}": seconds for name, seconds in self._seconds.items()}
        if self.origin is not None:
            for name, (start, end) in self._spans.items():
                out |= {f"phase/{name}/start": start - self.origin, f"phase/{name}/end": end - self.origin}
        self._seconds.clear()
        self._spans.clear()
        return out
