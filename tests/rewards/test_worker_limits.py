"""Reward processes bounded in memory and threads, recycled, and ended with everything they started
(megarl/rewards/worker_limits.py, pool.py)."""

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from megarl.rewards import pool as pool_module
from megarl.rewards import score
from megarl.rewards.failures import RewardFailureError, RewardFailureTracker
from megarl.rewards.pool import RewardPool
from megarl.rewards.worker_limits import RewardLimitError, WorkerLimits
from megarl.sandbox.cgroup import PREFIX
from megarl.utils.processes import with_environment

KEPT = []  # what a leaking reward keeps between calls, in its reward process


def keep_8_mib(response, answer, sample):
    KEPT.append(bytearray(b"\1") * (8 << 20))  # touched: resident, not only reserved
    return float(len(KEPT))


def allocate_at_once(response, answer, sample):
    if response == "big":
        held = bytearray(b"\1") * (600 << 20)  # past the cgroup, or RLIMIT_AS (twice the limit)
        return float(len(held))
    return 1.0


def children_holding_memory(response, answer, sample):
    """Two processes of 150 MiB each: each within a per-process limit of 256 MiB, together over it."""
    script = "x = bytearray(b'1') * (150 << 20); import time; time.sleep(60)"
    for _ in range(2):
        subprocess.Popen([sys.executable, "-c", script])
    time.sleep(30)
    return 1.0


def start_threads(response, answer, sample):
    for _ in range(int(response)):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return 1.0


def start_processes(response, answer, sample):
    for _ in range(int(response)):
        subprocess.Popen(["sleep", "60"])
    return 1.0


def fork_bomb(response, answer, sample):
    """Every process forks again and again, children included, each pausing a little between forks."""
    while True:
        try:
            os.fork()
        except OSError:  # EAGAIN: the kernel refused it; the bomb goes on trying
            pass
        time.sleep(0.05)


def daemonise(response, answer, sample):
    """A double fork: the child leaves the session (setsid) and exits; the grandchild, orphaned, runs on."""
    env = dict(os.environ, MEGARL_TEST_MARKER=sample["marker"])
    script = "import os, time; os.setsid(); os.fork() or time.sleep(300)"
    subprocess.Popen([sys.executable, "-c", script], env=env).wait()
    if response == "hang":
        time.sleep(60)
    return 1.0


def die_leaving_a_child(response, answer, sample):
    env = dict(os.environ, MEGARL_TEST_MARKER=sample["marker"])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
    os._exit(3)


def own_pid(response, answer, sample):
    return float(os.getpid())


def marked(marker: str) -> list[int]:
    return with_environment("MEGARL_TEST_MARKER", marker)


def samples(*responses, **fields):
    return [{"response": r, "answer": "", **fields} for r in responses]


@pytest.fixture(params=["cgroup", "rlimits"])
def memory_bound(request, monkeypatch):
    """Each way a reward process's memory is bounded: a memory cgroup (where this host allows one) or RLIMIT_AS."""
    if request.param == "rlimits":
        monkeypatch.setattr(pool_module, "memory_cgroups", lambda: None)
    elif pool_module.memory_cgroups() is None:
        pytest.skip("this host gives no memory cgroup")
    return request.param


def test_a_leaking_reward_is_recycled_before_its_memory_limit_and_loses_no_sample(memory_bound):
    reward = RewardPool(keep_8_mib, "keep_8_mib", WorkerLimits(memory_mb=256, max_threads=64, max_calls=0))
    try:
        scores = score(samples(*"x" * 30), reward, timeout_s=20.0)
    finally:
        reward.close()
    assert scores.failed == 0
    held = scores.rewards  # the chunks its process held: they start again at 1 in a new process
    assert held.count(1.0) >= 2 and reward.recycled >= held.count(1.0) - 1
    assert max(held) * 8 < 256 * 0.75  # replaced before 3/4 of the limit (the interpreter holds the rest)


def test_a_call_past_the_memory_limit_fails_named_and_the_next_runs_in_a_new_process(memory_bound):
    reward = RewardPool(allocate_at_once, "allocate_at_once", WorkerLimits(memory_mb=256, max_threads=64,
                                                                          max_calls=0))
    try:
        scores = score(samples("a", "big", "b"), reward, timeout_s=20.0)
    finally:
        reward.close()
    assert scores.rewards == [1.0, 0.0, 1.0]
    error = scores.failures[0].error
    assert isinstance(error, RewardLimitError)
    assert "reward 'allocate_at_once' passed its memory limit" in str(error)
    assert "reward.worker_memory_mb=256" in str(error)


def test_processes_that_together_pass_the_memory_limit_are_measured_and_killed(monkeypatch):
    monkeypatch.setattr(pool_module, "memory_cgroups", lambda: None)  # per process, each child is within its limit
    reward = RewardPool(children_holding_memory, "children", WorkerLimits(memory_mb=256, max_threads=64, max_calls=0))
    started = time.monotonic()
    try:
        scores = score(samples("a"), reward, timeout_s=25.0)
    finally:
        reward.close()
    assert time.monotonic() - started < 20  # at the watch, not at the call's 30 s or its timeout
    assert isinstance(scores.failures[0].error, RewardLimitError)
    assert "its reward process and the processes it started held" in str(scores.failures[0].error)


@pytest.fixture(params=["kernel", "measured"])
def thread_bound(request, monkeypatch):
    """Each way a reward process's threads are bounded: its cgroup's pids.max (where this host gives a cgroup with the
    pids controller), where the kernel refuses the thread past it, or only measured."""
    if request.param == "measured":
        monkeypatch.setattr(pool_module, "memory_cgroups", lambda: None)
    elif not kernel_bounds_threads():
        pytest.skip("this host gives no cgroup with the pids controller")
    return request.param


def kernel_bounds_threads() -> bool:
    return pool_module.memory_cgroups() is not None and pool_module.memory_cgroups().tasks_parent is not None


@pytest.mark.parametrize("fn", [start_threads, start_processes])
def test_threads_or_processes_left_running_past_the_limit_fail_the_call_by_name(fn, thread_bound):
    reward = RewardPool(fn, fn.__name__, WorkerLimits(memory_mb=4096, max_threads=32, max_calls=0))
    try:
        scores = score(samples("2", "40", "2"), reward, timeout_s=20.0)
    finally:
        reward.close()
    assert scores.rewards == [1.0, 0.0, 1.0]  # the third call runs in a fresh process
    error = str(scores.failures[0].error)
    if thread_bound == "kernel":  # refused at the 32nd thread: never more than the limit ran
        assert "tried to run more threads than reward.worker_max_threads=32 (the kernel refused" in error
    else:
        assert "its reward process and the processes it started ran " in error
        assert "threads, over reward.worker_max_threads=32" in error
    tracker = RewardFailureTracker(max_rate=0.1, window=1)
    tracker.add(scores)
    with pytest.raises(RewardFailureError) as failure:
        tracker.end_step(1)
    message = str(failure.value)
    assert f"reward {fn.__name__!r} passed its thread limit" in message
    assert "reward.worker_max_threads=32" in message
    assert "on sample 1 (response='40'" in message


def test_a_fork_bomb_is_held_at_the_thread_limit_by_the_kernel_and_fails_its_call():
    if not kernel_bounds_threads():  # measured only, a bomb grows until the next measurement: not run on a host
        pytest.skip("this host gives no cgroup with the pids controller")
    cgroups = pool_module.memory_cgroups()
    reward = RewardPool(fork_bomb, "fork_bomb", WorkerLimits(memory_mb=4096, max_threads=16, max_calls=0))
    started = time.monotonic()
    try:
        scores = score(samples("a"), reward, timeout_s=30.0)
        assert time.monotonic() - started < 15  # at the first watch after the refusal, not at the call's timeout
        assert "tried to run more threads than reward.worker_max_threads=16" in str(scores.failures[0].error)
        # the bomb's cgroups are gone, which the kernel allows only once no process is left in them
        live = {w.cgroup for w in reward.workers}
        assert set(cgroups.parent.glob(f"{PREFIX}reward-{os.getpid()}-*")) == live
        assert set(cgroups.tasks_parent.glob(f"{PREFIX}reward-{os.getpid()}-*")) == {cgroups.tasks_dir(p) for p in live}
    finally:
        reward.close()


@pytest.mark.parametrize("end", ["closed", "timed_out", "recycled"])
def test_a_daemonised_grandchild_ends_with_its_reward_process(end, memory_bound):
    """Found below its reward process (a subreaper) without a cgroup, as any user; in its cgroup too with one."""
    marker = uuid.uuid4().hex
    reward = RewardPool(daemonise, "daemonise", WorkerLimits(memory_mb=4096, max_threads=64,
                                                             max_calls=1 if end == "recycled" else 0))
    try:
        scores = score(samples("hang" if end == "timed_out" else "a", marker=marker), reward, timeout_s=3.0)
        assert scores.failed == (end == "timed_out")
        if end == "closed":
            assert len(marked(marker)) == 1  # it outlived the call, in a session of its own
            reward.close()
        assert not marked(marker)
    finally:
        reward.close()


def test_a_reward_process_that_dies_on_its_own_leaves_no_child(memory_bound):
    marker = uuid.uuid4().hex
    reward = RewardPool(die_leaving_a_child, "die", WorkerLimits(memory_mb=4096, max_threads=64, max_calls=0))
    try:
        scores = score(samples("a", marker=marker), reward, timeout_s=20.0)
        assert str(scores.failures[0].error) == "the reward process exited with status 3 during the call"
        assert not marked(marker)
    finally:
        reward.close()


def test_a_reward_process_is_replaced_after_worker_max_calls():
    reward = RewardPool(own_pid, "own_pid", WorkerLimits(memory_mb=4096, max_threads=64, max_calls=2))
    try:
        pids = score(samples(*"abcde"), reward).rewards
    finally:
        reward.close()
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


def test_the_cgroups_of_a_driver_that_is_gone_are_removed_at_start():
    cgroups = pool_module.memory_cgroups()
    if cgroups is None:
        pytest.skip("this host gives no memory cgroup")
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    stale = cgroups.create(f"reward-{gone.pid}-1", 64 << 20, max_tasks=8)
    ours = cgroups.create(f"reward-{os.getpid()}-1", 64 << 20, max_tasks=8)
    try:
        pool_module.remove_stale_cgroups(cgroups)
        assert not stale.exists() and ours.exists()
        if cgroups.tasks_parent is not None:  # under v1 a directory of the pids hierarchy too
            assert not cgroups.tasks_dir(stale).exists() and cgroups.tasks_dir(ours).exists()
    finally:
        cgroups.remove(ours)
        if stale.exists():
            cgroups.remove(stale)
