"""trainer.eval_every: the held-out set is evaluated before RL, every N-th step and after the last; 0 evaluates
before RL and after the last step only; a negative value is refused by key."""

import json

import pytest

from megarl.config import ConfigError
from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer, evaluates_after
from megarl.utils.tracking import run_dir

from tests.conftest import QUICKSTART


def test_eval_every_steps():
    assert [s for s in range(1, 8) if evaluates_after(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 7) if evaluates_after(s, 3, 6)] == [3, 6]
    assert [s for s in range(1, 8) if evaluates_after(s, 0, 7)] == [7]
    assert [s for s in range(1, 8) if evaluates_after(s, 1, 7)] == list(range(1, 8))
    with pytest.raises(ConfigError, match="trainer.eval_every=-1: must be >= 0"):
        tiny_config(["trainer.eval_every=-1"], path=QUICKSTART)


def test_eval_every_0_evaluates_before_rl_and_after_the_last_step(tmp_path, ray_local):
    cfg = tiny_config([
        f"trainer.output_dir={tmp_path}", "trainer.steps=2", "trainer.eval_every=0", "data.prompts_per_step=2",
        "rollout.n_samples=2", "data.val_size=2", "rollout.eval_n_samples=1", "sft.steps=0", "actor.parallel.tp=1",
        "actor.parallel.world_size=1", "trainer.loggers=jsonl", "model.tiny_num_layers=1"], path=QUICKSTART)
    trainer = RLTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert sorted(history["val/reward"]) == [0, 2]
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/reward" in r] == [0, 2]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2]
