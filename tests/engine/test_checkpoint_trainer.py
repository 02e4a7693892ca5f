"""Checkpoints through the real trainer (Ray workers, rollout actor): two RL steps with a checkpoint
after each, then a second RLTrainer at another layout (TP=2 -> DP=2) resumes and takes a third."""

import json

import torch

from megarl.config import load_config
from megarl.engine.checkpoint import read_checkpoint_file
from megarl.trainer import RLTrainer

from tests.conftest import QUICKSTART as RECIPE


def config(tmp_path, *overrides):
    return load_config(RECIPE, [
        f"trainer.output_dir={tmp_path}", "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8",
        "rollout.eval_n_samples=1", "sft.steps=2", "sft.batch_size=8", "trainer.eval_every=2",
        "trainer.save_every=1", "trainer.keep_last=2", "trainer.loggers=jsonl", *overrides])


def test_trainer_resumes_at_another_layout(tmp_path, ray_local):
    first = RLTrainer(config(tmp_path, "trainer.steps=2"))
    try:
        history = first.fit()
        weights = first.actor.call("hf_state_dict")[0]
        data_state = first.data.state_dict()
    finally:
        first.shutdown()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert (root / "latest").read_text().strip() == "step_00000002"

    second = RLTrainer(config(tmp_path, "trainer.steps=3", "actor.parallel.tp=1"))  # DP=2 now
    try:
        assert second.resume() == 2
        assert second.version == 2 and second.data.state_dict() == data_state
        resumed = second.actor.call("hf_state_dict")[0]
        assert resumed.keys() == weights.keys()
        for name in weights:  # resharded TP=2 -> DP=2 by dist checkpointing: the same numbers
            assert torch.equal(resumed[name], weights[name]), name
        history_after = second.fit()  # resumes again (auto: step 2) and takes step 3
        assert second.version == 3
    finally:
        second.shutdown()
    assert set(history_after["val/reward"]) == {0, 2, 3}
    assert {k: history_after["val/reward"][k] for k in (0, 2)} == history["val/reward"]
    # keep_last=2: step 1 was deleted once step 3 was complete
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    state = read_checkpoint_file(root / "step_00000003")
    assert state["step"] == 3 and state["driver"]["version"] == 3 and state["roles"] == ["actor"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3]  # the resumed run did not redo 1-2
