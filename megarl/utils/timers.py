"""Wall-clock timing of the phases of a step: `with timers("generate"): ...`, then `timers.pop()`."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


class Timers:
    """Accumulates wall time per name until `pop`. Wall time is what the driver waits for: remote work
    (Ray calls, GPU kernels) counts only once the timed block waits for its result."""

    def __init__(self):
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """{'timing/<name>': seconds} accumulated since the last pop; resets the totals."""
        out = {f"timing/{name}": seconds for name, seconds in self._seconds.items()}
        self._seconds.clear()
        return out
