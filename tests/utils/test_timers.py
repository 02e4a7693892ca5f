import time

import pytest

from megarl.utils import timers as timers_module
from megarl.utils.timers import Timers


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_accumulates_per_name_and_pop_resets(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timers_module.time, "perf_counter", clock)
    timers = Timers()
    with timers("step"):
        with timers("generate"):
            clock.now += 2.0
        with timers("train"):
            clock.now += 0.5
        with timers("generate"):  # a second block adds to the first
            clock.now += 1.0
    assert timers.pop() == {"timing/step": 3.5, "timing/generate": 3.0, "timing/train": 0.5}
    assert timers.pop() == {}


def test_time_is_recorded_when_the_block_raises(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timers_module.time, "perf_counter", clock)
    timers = Timers()
    with pytest.raises(RuntimeError):
        with timers("sync"):
            clock.now += 0.25
            raise RuntimeError("boom")
    assert timers.pop() == {"timing/sync": 0.25}


def test_measures_real_wall_time():
    timers = Timers()
    with timers("sleep"):
        time.sleep(0.05)
    assert timers.pop()["timing/sleep"] >= 0.05
