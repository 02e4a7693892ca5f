"""Reward functions in reward processes (reward.isolation=process): a call past its limit has its process
killed and replaced, so a reward stuck where no signal reaches costs a sample, not the run."""

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.config import RewardConfig
from megarl.rewards import build_reward, score
from megarl.rewards.pool import RewardIsolationError
from megarl.rewards.scoring import RewardCallError, _alarm

ROOT = Path(__file__).resolve().parents[2]


def stuck_in_c(response, answer, sample):
    """On 'stuck', one C call that holds the GIL and checks no signal for minutes (SIGALRM waits for it)."""
    if response == "stuck":
        with open(sample["pid_file"], "w") as f:
            f.write(str(os.getpid()))
        sum(range(3 * 10**9))
    return float(response == answer)


def test_a_reward_stuck_in_a_c_call_is_killed_and_the_batch_goes_on(tmp_path):
    reward = build_reward(RewardConfig(name=f"{__name__}:stuck_in_c"))
    pid_file = tmp_path / "pid"
    batch = [{"response": r, "answer": "ok", "pid_file": str(pid_file)} for r in ("ok", "stuck", "no", "ok")]
    scores = score(batch, reward, timeout_s=2.0)
    assert scores.rewards == [1.0, 0.0, 0.0, 1.0] and scores.failed == 1
    assert "reward.timeout_s=2" in str(scores.failures[0].error)
    stuck = int(pid_file.read_text())
    assert stuck != os.getpid()
    with pytest.raises(ProcessLookupError):  # killed, not left running
        os.kill(stuck, 0)
    assert score(batch[:1], reward).rewards == [1.0]  # its replacement takes the next batch


def exit_on_crash(response, answer, sample):
    if response == "crash":
        os._exit(3)  # as a segfault in an extension would end it
    return 1.0


def test_a_reward_that_ends_its_process_fails_its_sample_only():
    reward = build_reward(RewardConfig(name=f"{__name__}:exit_on_crash", num_workers=2))
    scores = score([{"response": r, "answer": ""} for r in ("a", "crash", "b", "crash", "c")], reward, num_workers=2)
    assert scores.rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [str(f.error) for f in scores.failures] == ["the reward process exited with status 3 during the call"] * 2


def make_closure_reward():
    lock = threading.Lock()

    def reward(response, answer, sample):
        with lock:
            return 0.5
    return reward


closure_reward = make_closure_reward()


def test_a_reward_that_cannot_be_pickled_names_isolation_none():
    with pytest.raises(RewardIsolationError, match=r"closure_reward.*cannot be pickled.*reward\.isolation=none"):
        build_reward(RewardConfig(name=f"{__name__}:closure_reward"))
    in_process = build_reward(RewardConfig(name=f"{__name__}:closure_reward", isolation="none"))
    assert score([{"response": "", "answer": ""}], in_process).rewards == [0.5]


def raise_value_error(response, answer, sample):
    raise ValueError(f"cannot parse {answer!r}")


def test_a_reward_error_comes_back_with_its_text_and_place():
    scores = score([{"response": "r", "answer": "#### x"}], build_reward(RewardConfig(name=f"{__name__}:raise_value_error")))
    assert scores.failed == 1
    assert str(scores.failures[0].error).startswith("ValueError: cannot parse '#### x' (at ")
    assert "test_isolation.py" in str(scores.failures[0].error)


def test_the_math_reward_starts_its_checking_process_from_a_reward_process():
    reward = build_reward(RewardConfig(name="math"))
    batch = [{"response": "so \\boxed{\\frac{1}{2}}", "answer": "0.5"}, {"response": "\\boxed{3}", "answer": "2"}]
    scores = score(batch, reward, timeout_s=60)
    assert (scores.rewards, scores.failed) == ([1.0, 0.0], 0)


def _refuse_elsewhere(pid):
    if os.getpid() != pid:
        raise ImportError("No module named 'my_driver_script'")
    return OnlyHere()


class OnlyHere:
    """Pickles, but unpickles only in this process (as a reward defined in a driver script's __main__)."""

    def __reduce__(self):
        return _refuse_elsewhere, (os.getpid(),)

    def __call__(self, response, answer, sample):
        return 1.0


only_here = OnlyHere()


def test_a_reward_that_does_not_load_in_a_reward_process_names_isolation_none():
    reward = build_reward(RewardConfig(name=f"{__name__}:only_here"))
    with pytest.raises(RewardIsolationError, match=r"does not unpickle in a fresh process \(ImportError: No module "
                                                   r"named 'my_driver_script'\); set reward\.isolation=none"):
        score([{"response": "", "answer": ""}], reward)


DRIVER = """
import sys, time
from megarl.config import RewardConfig
from megarl.rewards import build_reward, score
score([{"response": "", "answer": ""}], build_reward(RewardConfig(name="tests.rewards.test_isolation:sleep_long")))
"""


def sleep_long(response, answer, sample):
    print(os.getpid(), flush=True)
    time.sleep(600)  # releases the GIL, as a stuck ctypes or socket call would
    return 1.0


def test_a_killed_driver_leaves_no_reward_process_running():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    worker = int(driver.stdout.readline())
    driver.kill()  # SIGKILL: no atexit, nothing of the driver's runs
    driver.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(worker, 9)
    pytest.fail(f"reward process {worker} still ran 30 s after its driver was killed")


# A worker's failure fails its sample, never hangs the driver: each test would have hung (the guard fails it), stopped
# the run with the worker's exception, or (tensors) failed every sample at a process start each.
HANG_GUARD_S = 30.0


def process_id(response, answer, sample):
    return float(os.getpid())


def tensor_sum(response, answer, sample):
    return float(sample["weights"].sum())


def test_a_sample_with_a_tensor_reaches_the_reward_process_by_value():
    import torch

    reward = build_reward(RewardConfig(name=f"{__name__}:tensor_sum"))
    with _alarm(HANG_GUARD_S, TimeoutError("hung")):
        scores = score([{"response": "", "answer": "", "weights": torch.arange(4.0) * i} for i in (1, 2)], reward)
    assert (scores.rewards, scores.failed) == ([6.0, 12.0], 0)


def test_a_sample_that_does_not_unpickle_in_the_reward_process_fails_alone():
    reward = build_reward(RewardConfig(name=f"{__name__}:process_id"))
    batch = [{"response": "", "answer": "", "field": field} for field in (1, only_here, 2)]
    with _alarm(HANG_GUARD_S, TimeoutError("hung")):
        scores = score(batch, reward)
    assert [f.index for f in scores.failures] == [1]
    assert str(scores.failures[0].error) == ("the sample does not unpickle in the reward process (ImportError: No "
                                             "module named 'my_driver_script')")
    assert scores.rewards[0] == scores.rewards[2] != os.getpid()  # the same process went on


def test_a_sample_that_cannot_be_pickled_fails_alone_and_the_next_batch_runs():
    reward = build_reward(RewardConfig(name=f"{__name__}:process_id"))
    with _alarm(HANG_GUARD_S, TimeoutError("hung")):
        scores = score([{"response": "", "answer": "", "lock": lock} for lock in (1, threading.Lock(), 2)], reward)
        assert [(f.index, str(f.error)) for f in scores.failures] == [
            (1, "the sample cannot be sent to a reward process (TypeError: cannot pickle '_thread.lock' object)")]
        assert score([{"response": "", "answer": ""}], reward).failed == 0


class TwoPartError(RewardCallError):
    def __init__(self, what, why):  # pickles, but unpickles as TwoPartError(message): a TypeError
        super().__init__(f"{what}: {why}")


def raise_two_part_error(response, answer, sample):
    raise TwoPartError("parse", answer)


def test_an_answer_that_does_not_unpickle_in_the_driver_fails_its_sample():
    reward = build_reward(RewardConfig(name=f"{__name__}:raise_two_part_error"))
    with _alarm(HANG_GUARD_S, TimeoutError("hung")):
        scores = score([{"response": "", "answer": "x"}], reward)
        assert str(scores.failures[0].error).startswith("the reward process's answer does not unpickle (TypeError: ")
        assert score([{"response": "", "answer": "y"}], reward).failed == 1  # the pool goes on


def exit_leaving_a_child(response, answer, sample):
    if os.fork() == 0:  # the child holds the worker's socket open: only the worker's exit says it died
        with open(sample["pid_file"] + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.rename(sample["pid_file"] + ".part", sample["pid_file"])  # whole when seen: the kill may come next
        time.sleep(60)
        os._exit(0)
    while not os.path.exists(sample["pid_file"]):
        time.sleep(0.01)
    os._exit(3)


@pytest.mark.parametrize("exit_seen_by", ["pidfd", "pipe"])
def test_a_reward_process_that_dies_leaving_a_child_fails_its_sample(tmp_path, monkeypatch, exit_seen_by):
    reward = build_reward(RewardConfig(name=f"{__name__}:exit_leaving_a_child"))
    refused = []

    def no_pidfd(pid: int) -> int:
        refused.append(pid)
        raise OSError(38, "Function not implemented")  # ENOSYS: a kernel before 5.3

    with monkeypatch.context() as patched, _alarm(HANG_GUARD_S, TimeoutError("hung")):
        if exit_seen_by == "pipe":  # no pidfd: a thread reaps the worker and closes a pipe
            patched.setattr(os, "pidfd_open", no_pidfd)
        scores = score([{"response": "", "answer": "", "pid_file": str(tmp_path / "child")}], reward)  # no time limit
    assert bool(refused) == (exit_seen_by == "pipe")  # every worker started without a pidfd
    assert str(scores.failures[0].error) == "the reward process exited with status 3 during the call"
    assert exited_within(int((tmp_path / "child").read_text()), 10.0)  # killed with its worker


def exited_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` (ours or not; a zombie has exited) exits within `seconds`."""
    try:
        exited = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([exited], [], [], seconds)[0])
    finally:
        os.close(exited)


def test_a_reward_process_killed_while_idle_fails_the_sample_sent_to_it():
    reward = build_reward(RewardConfig(name=f"{__name__}:process_id"))
    worker = int(score([{"response": "", "answer": ""}], reward).rewards[0])
    os.kill(worker, signal.SIGKILL)
    assert exited_within(worker, 10.0)
    with _alarm(HANG_GUARD_S, TimeoutError("hung")):
        scores = score([{"response": "", "answer": ""}] * 2, reward)
    assert [(f.index, str(f.error)) for f in scores.failures] == [
        (0, "the reward process exited with status -9 during the call")]
    assert scores.rewards[1] not in (0.0, worker)


def sleep_on_slow(response, answer, sample):
    if response == "slow":
        time.sleep(600)
    return 1.0


def test_a_batch_interrupted_leaves_no_call_running_into_the_next():
    reward = build_reward(RewardConfig(name=f"{__name__}:sleep_on_slow"))
    with pytest.raises(KeyboardInterrupt), _alarm(2.0, KeyboardInterrupt()):
        score([{"response": "slow", "answer": ""}], reward)
    with _alarm(HANG_GUARD_S, TimeoutError("hung")):  # not waiting on the slow call's worker: it was killed
        assert score([{"response": "fast", "answer": ""}], reward).rewards == [1.0]
