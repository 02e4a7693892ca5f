import threading
import time

import pytest

from megarl.config import ConfigError, RewardConfig
from megarl.config.tiny import tiny_config
from megarl.rewards import REWARD_BUILDERS, build_reward, get_reward_fn, score


def spin_or_score(response, answer, sample):
    """A reward with a bug that never returns on 'hang' (pure Python, like a runaway simplification)."""
    while response == "hang":
        pass
    if response == "sleep":
        time.sleep(5)
    return float(response == answer)


def samples(*responses):
    return [{"response": r, "answer": "ok"} for r in responses]


def outcome(scores):
    return scores.rewards, scores.failed


def test_timeout_interrupts_a_hung_reward_in_the_main_thread():
    start = time.monotonic()
    assert outcome(score(samples("ok", "hang", "no", "ok"), spin_or_score, timeout_s=0.3)) == ([1.0, 0.0, 0.0, 1.0], 1)
    assert time.monotonic() - start < 2


def test_threads_abandon_a_call_past_its_limit_and_go_on():
    start = time.monotonic()
    scores = score(samples("sleep", "ok", "sleep", "no", "ok"), spin_or_score, timeout_s=0.3, num_workers=2)
    assert outcome(scores) == ([0.0, 1.0, 0.0, 0.0, 1.0], 2)
    assert time.monotonic() - start < 2  # the sleeping calls did not hold up the others


def test_threads_run_calls_at_once_in_sample_order():
    def slow(response, answer, sample):
        time.sleep(0.2)
        return float(response)

    start = time.monotonic()
    assert outcome(score(samples(*"01234567"), slow, num_workers=8)) == ([float(i) for i in range(8)], 0)
    assert time.monotonic() - start < 1.0  # 8 x 0.2 s one by one would be 1.6 s


def test_off_the_main_thread_the_timeout_still_holds():
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=score(samples("sleep", "ok"), spin_or_score, 2.0)))
    thread.start()
    thread.join(15)
    assert outcome(out["r"]) == ([0.0, 1.0], 1)


class BatchReward:
    """A batch-level reward (how a reward model plugs in): one call for all samples."""
    calls = 0

    def score_batch(self, batch):
        BatchReward.calls += 1
        if any(s["response"] == "explode" for s in batch):
            raise RuntimeError("server down")
        return [len(s["response"]) for s in batch[:-1]] + [float("inf")]


def test_batch_rewards_are_called_once_and_fail_as_a_whole():
    REWARD_BUILDERS.register("test_batch_reward")(lambda cfg: BatchReward())
    reward = build_reward(RewardConfig(name="test_batch_reward"))
    assert outcome(score(samples("ab", "abc", "x"), reward)) == ([2.0, 3.0, 0.0], 1)  # inf is a failure
    assert outcome(score(samples("ab", "explode"), reward)) == ([0.0, 0.0], 2)
    assert BatchReward.calls == 2


def test_build_reward_by_name_default_and_path():
    assert build_reward(RewardConfig(isolation="none"), "reverse") is get_reward_fn("reverse")
    assert build_reward(RewardConfig(name=f"{__name__}:spin_or_score")).fn is spin_or_score  # in a RewardPool
    with pytest.raises(ConfigError, match="reward.name='gsm8': unknown reward 'gsm8'; did you mean 'gsm8k'"):
        build_reward(RewardConfig(name="gsm8"))


def test_reward_config_is_checked():
    with pytest.raises(ConfigError, match="reward.remote_url"):
        tiny_config(["reward.name=remote"])
    with pytest.raises(ConfigError, match="reward.num_workers=0"):
        tiny_config(["reward.num_workers=0"])
    assert tiny_config(["data.task=a.parquet", "reward.name=gsm8k"]).reward.timeout_s == 30.0


def sleep_for_response(response, answer, sample):
    time.sleep(float(response))
    return 1.0


@pytest.mark.parametrize("isolation, num_workers", [("process", 2), ("none", 2), ("none", 1)])
def test_a_batch_past_its_timeout_fails_what_is_unfinished(isolation, num_workers):
    reward = build_reward(RewardConfig(name=f"{__name__}:sleep_for_response", isolation=isolation))
    # two quick calls, then calls that would sleep 60 s each: the batch's 4 s are gone before they finish
    responses = ["0", "0", "60", "60", "0", "0"] if num_workers == 2 else ["0", "60", "0"]
    # the reward processes start first: on a loaded machine their start alone can take the batch's 4 s
    assert score(samples(*["0"] * num_workers), reward, timeout_s=120, num_workers=num_workers).failed == 0
    scores = score(samples(*responses), reward, timeout_s=120, num_workers=num_workers, batch_timeout_s=4)
    assert scores.rewards == [1.0] * num_workers + [0.0] * (len(responses) - num_workers)
    assert scores.failed == len(responses) - num_workers
    assert all("reward.batch_timeout_s" in str(f.error) for f in scores.failures)


def test_reward_config_keys_for_failures_are_checked():
    for key, bad in (("isolation", "thread"), ("max_failure_rate", 1.5), ("failure_window", 0),
                     ("batch_timeout_s", -1), ("remote_max_timeouts", 0)):
        with pytest.raises(ConfigError, match=f"reward.{key}="):
            tiny_config([f"reward.{key}={bad}"])
    assert tiny_config().reward.isolation == "process"


def test_a_process_reward_scores_rows_with_images():
    """A vision-language batch's rows carry image tensors; the samples a reward process gets hold none of them (a
    tensor sent to a process goes through shared memory, which the reward worker's connection refused)."""
    import torch

    from megarl.protocol import Batch

    batch = Batch({"rewards": torch.zeros(2)}, {"response": ["1", "2"], "answer": ["1", "1"], "group": [0, 0],
                                                "pixel_values": [torch.ones(4, 3)] * 2,
                                                "image_grid_thw": [torch.tensor([[1, 2, 2]])] * 2})
    scores = score(batch, build_reward(RewardConfig(name="exact_match", isolation="process")), timeout_s=60)
    assert outcome(scores) == ([1.0, 0.0], 0)
