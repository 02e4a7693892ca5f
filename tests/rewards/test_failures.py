"""A run whose reward keeps failing stops with the reward's own error; evaluation counts its failures."""

import pytest

from megarl.config import RewardConfig
from megarl.rewards import score
from megarl.rewards.failures import RewardFailureError, RewardFailureTracker

from tests.algorithms.test_sampling_loop import ScriptedSampler


def fail_on_boom(response, answer, sample):
    if response == "boom":
        raise KeyError("no 'answer' column in the reference")
    return float(response == answer)


def batch(*responses):
    return [{"prompt": "2+2?", "response": r, "answer": "ok"} for r in responses]


def test_failure_rate_over_the_window_stops_with_the_first_error_and_its_sample():
    tracker = RewardFailureTracker(max_rate=0.5, window=2)
    tracker.add(score(batch("ok", "boom", "ok", "ok"), fail_on_boom))
    assert tracker.end_step(1) == 1  # 1 of 4
    tracker.add(score(batch("boom", "ok"), fail_on_boom))  # two scoring calls in one step (e.g. sampling rounds)
    tracker.add(score(batch("boom", "boom"), fail_on_boom))
    assert tracker.end_step(2) == 3  # steps 1-2: 4 of 8, not more than half
    tracker.add(score(batch("boom", "ok"), fail_on_boom))
    with pytest.raises(RewardFailureError) as stop:
        tracker.end_step(3)  # steps 2-3 (step 1 left the window): 4 of 6
    message = str(stop.value)
    assert message.startswith("training reward calls failed 4 of 6 times in step 2 to 3 (67%, more than "
                              "reward.max_failure_rate=0.5); the first, at step 2: KeyError: \"no 'answer' column")
    assert "on sample 0 (prompt='2+2?', response='boom', answer='ok')" in message
    assert isinstance(stop.value.__cause__, KeyError)  # with the reward's own traceback


def test_a_reward_failing_everywhere_stops_at_the_first_step():
    tracker = RewardFailureTracker.from_config(RewardConfig())
    tracker.add(score(batch("boom", "boom"), fail_on_boom))
    with pytest.raises(RewardFailureError, match="failed 2 of 2 times in step 1 "):
        tracker.end_step(1)
    never = RewardFailureTracker.from_config(RewardConfig(max_failure_rate=1.0))
    never.add(score(batch("boom"), fail_on_boom))
    assert never.end_step(1) == 1


def test_evaluation_counts_reward_failures_and_stops_past_the_limit():
    from megarl.trainer import RLTrainer

    trainer = RLTrainer.__new__(RLTrainer)
    trainer.sampler = ScriptedSampler([["ok", "boom", "ok", "ok"], ["boom", "boom", "boom", "ok"]])
    trainer.sampler.reward_fn = fail_on_boom
    trainer.cfg, trainer.version = trainer.sampler.cfg, 0
    trainer.val = [{"prompt": "a", "answer": "ok"}, {"prompt": "b", "answer": "ok"}]
    metrics = trainer.validate()
    assert metrics["val/reward_failures"] == 1 and metrics["val/reward"] == 0.75
    with pytest.raises(RewardFailureError, match="^evaluation reward calls failed 3 of 4 times in step 0 "):
        trainer.validate()  # judged on its own, whatever the previous evaluation did


EVALUATION_CALLS = 2 * 4  # data.val_size x rollout.eval_n_samples below
calls = []


def right_then_broken(response, answer, sample):
    """Scores the first evaluation, then fails like a reward server gone away."""
    calls.append(response)
    if len(calls) > EVALUATION_CALLS:
        raise ConnectionError("reward server at 10.0.0.7:8000 refused the connection")
    return 0.5


def test_a_run_whose_rewards_fail_stops_before_training_on_them(tmp_path, ray_local):
    from megarl.config.tiny import tiny_config
    from megarl.trainer import RLTrainer

    from tests.conftest import QUICKSTART

    cfg = tiny_config([
        f"trainer.output_dir={tmp_path}", "actor.parallel.world_size=1", "actor.parallel.tp=1", "sft.steps=0",
        "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2", "trainer.steps=3",
        "trainer.loggers=[jsonl]", f"reward.name={__name__}:right_then_broken", "reward.isolation=none"], path=QUICKSTART)
    calls.clear()
    trainer = RLTrainer(cfg)
    try:
        with pytest.raises(RewardFailureError, match="training reward calls failed 4 of 4 times in step 1 .*"
                                                     "ConnectionError: reward server at 10.0.0.7:8000 refused"):
            trainer.fit()
        assert trainer.version == 0  # no update was made on the zeros
    finally:
        trainer.shutdown()
