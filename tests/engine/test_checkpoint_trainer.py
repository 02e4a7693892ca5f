"""Checkpoints through the real trainer (Ray workers, rollout actor): two RL steps with a checkpoint
after each, then a second RLTrainer at another layout (TP=2 -> DP=2) resumes and takes a third."""

import json

import torch

from megarl.config.tiny import tiny_config
from megarl.engine.checkpoint import Checkpoints, read_checkpoint_file
from megarl.resume import plan_resume
from megarl.rewards.mixing import ScoreMixer
from megarl.rollout.agent import Trajectory
from megarl.sampler import Sampler
from megarl.trainer import RLTrainer
from megarl.utils.timers import Timers
from megarl.utils.tracking import Tracker, run_dir

from tests.conftest import QUICKSTART as RECIPE


def config(tmp_path, *overrides):
    return tiny_config([
        f"trainer.output_dir={tmp_path}", "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8",
        "rollout.eval_n_samples=1", "sft.steps=2", "sft.batch_size=8", "trainer.eval_every=2",
        "trainer.save_every=1", "trainer.keep_last=2", "trainer.loggers=jsonl", *overrides], path=RECIPE)


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
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3]  # the resumed run did not redo 1-2


def metric_rows(output_dir, after_step: int) -> dict[int, dict]:
    """metrics.jsonl's rows of the steps after `after_step`, without wall-clock readings (timings, rates)."""
    clock = ("timing/", "perf/", "sync/seconds", "sync/gb_per_s")
    rows = {}
    for line in (run_dir(output_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] > after_step and "train/reward" in row:
            rows[row["step"]] = {k: v for k, v in row.items()
                                 if not k.startswith(clock) and not (k.startswith("sync/") and k.endswith("_s"))}
    return rows


def run(cfg) -> dict[str, torch.Tensor]:
    """fit() to the end; the policy's final weights."""
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        return trainer.actor.call("hf_state_dict")[0]
    finally:
        trainer.shutdown()


def test_resumed_run_equals_the_uninterrupted_one_bitwise(tmp_path, ray_local):
    """Stopped after step 1 (trainer.steps=1, then a run with steps=3), or killed after step 1's checkpoint
    was committed, then resumed: every logged number of steps 2-3 and the final weights are those of the run
    that was never interrupted. The killed case resumes from the uninterrupted run's own step-1 checkpoint
    in a fresh process and directory: a SIGKILL after that commit leaves exactly that directory on disk
    (later steps write only new checkpoints; keep_last=0 keeps it), and nothing else of a run is read back."""
    def cfg(out, *overrides):  # sampled evaluation (as the quickstart's), an eval at step 2 only, syncs 0 and 2
        return config(out, "trainer.keep_last=0", "rollout.eval_n_samples=2", "trainer.eval_every=2",  # verified
                      "trainer.verify_weight_sync_every=2", *overrides)

    whole = run(cfg(tmp_path / "whole", "trainer.steps=3"))
    expected = metric_rows(tmp_path / "whole", 1)
    assert sorted(expected) == [2, 3]

    run(cfg(tmp_path / "stopped", "trainer.steps=1"))
    after_stop = run(cfg(tmp_path / "stopped", "trainer.steps=3"))
    after_kill = run(cfg(tmp_path / "killed", "trainer.steps=3",
                         f"trainer.resume={tmp_path / 'whole' / 'checkpoints' / 'step_00000001'}"))
    for name, resumed_output, weights in (("stop", "stopped", after_stop), ("kill", "killed", after_kill)):
        got = metric_rows(tmp_path / resumed_output, 1)
        assert sorted(got) == [2, 3], name
        differing = {(step, key): (got[step].get(key), value) for step, row in expected.items()
                     for key, value in row.items() if got[step].get(key) != value}
        assert not differing and got == expected, (name, differing)
        assert weights.keys() == whole.keys()
        for key in whole:
            assert torch.equal(weights[key], whole[key]), (name, key)


class Stateful:
    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def driver_only(tmp_path, *overrides) -> RLTrainer:
    """An RLTrainer without engines or workers: its checkpoint methods over the driver's own state."""
    trainer = object.__new__(RLTrainer)
    trainer.cfg = tiny_config([f"trainer.output_dir={tmp_path}", "algorithm.kl_coef=0", *overrides], path=RECIPE)
    trainer.start = plan_resume(trainer.cfg)
    trainer.tracker = Tracker(run_dir(tmp_path, trainer.start.run_id), ["jsonl"])  # a resume: the checkpoint's id
    trainer.checkpoints = Checkpoints(tmp_path / "checkpoints", keep_last=0)
    trainer.trained_groups = dict
    trainer.data, trainer.sft_data, trainer.kl_ctl = Stateful({}), Stateful({}), Stateful({})
    trainer.score_mixer, trainer.policy_filter = ScoreMixer.from_config(trainer.cfg.reward_model), None
    trainer.version, trainer.syncs, trainer.history = 0, 0, {"val/reward": {}}
    trainer.timers = Timers()
    trainer.sampler = Sampler(trainer.cfg, None, None, trainer.data, None, trainer.timers)
    trainer.publish_policy = lambda: setattr(trainer, "syncs", trainer.syncs + 1)  # a sync, counted
    return trainer


def test_checkpoint_keeps_unfinished_groups_and_the_sync_count(tmp_path):
    """Over-sampling's aborted groups (continued next step, with the turns they had), the number of weight
    syncs (which of the next ones are verified) and the reward model's running score moments come back from a
    checkpoint as they were saved; metrics.jsonl loses the rows of the steps the resumed run redoes."""
    saved = driver_only(tmp_path)
    group = [Trajectory(0, [5, 6], response_ids=[7, 8], loss_mask=[1, 1], logprobs=[-0.5, -0.25],
                        turns=[{"role": "assistant", "text": "x", "span": [0, 2], "stopped": False, "tool_calls": []}],
                        policy_version=1) for _ in range(2)]
    prompt = {"prompt": "p", "answer": "a", "prompt_ids": [5, 6], "extra": {"id": 7}}  # any field of the data file
    saved.version, saved.syncs, saved.sampler.partial_groups = 2, 3, [(prompt, group)]
    saved.score_mixer.moments.update(torch.tensor([1.0, 2.0, 4.0]))  # reward_model.normalize=running's moments
    saved.save_checkpoint(2)
    saved.sampler.partial_groups = []
    saved.save_checkpoint(3)  # none left unfinished: nothing to continue from this one
    for step in (1, 2, 3):
        saved.tracker.log({"train/reward": step}, step)
    saved.tracker.close()

    resumed = driver_only(tmp_path, f"trainer.resume={tmp_path / 'checkpoints' / 'step_00000002'}")
    assert resumed.resume() == 2 and resumed.version == 2
    assert [json.loads(row)["step"] for row in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert resumed.syncs == 3  # the resume's own sync (verified: the first of this process) is not counted
    assert resumed.sampler.partial_groups == [(prompt, group)]
    assert resumed.score_mixer.state_dict() == saved.score_mixer.state_dict() and resumed.score_mixer.moments.count == 3
    latest = driver_only(tmp_path)
    assert latest.resume() == 3 and latest.sampler.partial_groups == []

