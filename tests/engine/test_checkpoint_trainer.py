"""Checkpoints through the real trainer (Ray workers, rollout actor): a run stopped after step 1 and continued in
its directory to step 3 equals a run never stopped, bit for bit, as does one resumed in a fresh process from that
run's step-1 checkpoint; a second RLTrainer at another layout (TP=2 -> DP=2) resumes the continued run and takes
step 4."""

import json
from types import SimpleNamespace

import pytest
import torch

from megarl.config.tiny import tiny_config
from megarl.engine.checkpoint_dir import Checkpoints, read_checkpoint_file
from megarl.resume import plan_resume
from megarl.rewards.mixing import ScoreMixer
from megarl.rollout.agent import Trajectory
from megarl.sampler import Sampler
from megarl.trainer import RLTrainer
from megarl.utils.timers import Timers
from megarl.utils.tracking import Tracker, run_dir

from tests.conftest import QUICKSTART as RECIPE


def config(tmp_path, *overrides):
    # sampled evaluation (as the quickstart's) every 2 steps and at the end; syncs 0 and 2 verified; every checkpoint
    # kept unless a run says otherwise
    return tiny_config([
        f"trainer.output_dir={tmp_path}", "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8",
        "rollout.eval_n_samples=2", "sft.steps=2", "sft.batch_size=8", "trainer.eval_every=2",
        "trainer.verify_weight_sync_every=2", "trainer.save_every=1", "trainer.keep_last=0",
        "trainer.loggers=jsonl", *overrides], path=RECIPE)


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


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, ray_local) -> SimpleNamespace:
    """A run stopped after step 1 (trainer.steps=1), then a run with steps=3 in its directory (TP=2): the directory,
    and as the second run left them its metric rows of steps 2-3, final weights, data position and held-out reward
    by step. Both tests below read it; the layout test continues it (taken before, the rows stay those of step 3)."""
    out = tmp_path_factory.mktemp("stopped")
    run(config(out, "trainer.steps=1"))
    trainer = RLTrainer(config(out, "trainer.steps=3"))
    try:
        history = trainer.fit()
        weights = trainer.actor.call("hf_state_dict")[0]
        data_state = trainer.data.state_dict()
    finally:
        trainer.shutdown()
    return SimpleNamespace(dir=out, rows=metric_rows(out, 1), weights=weights, data_state=data_state, history=history)


def test_trainer_resumes_at_another_layout(stopped):
    root = stopped.dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002", "step_00000003"]
    assert (root / "latest").read_text().strip() == "step_00000003"

    second = RLTrainer(config(stopped.dir, "trainer.steps=4", "actor.parallel.tp=1", "trainer.keep_last=2"))  # DP=2
    resume, resumed = second.resume, {}

    def resume_and_read() -> int:  # fit's own resume (auto: step 3), read before it takes step 4
        done = resume()
        resumed.update(done=done, version=second.version, data=second.data.state_dict(),
                       weights=second.actor.call("hf_state_dict")[0])
        return done
    second.resume = resume_and_read
    try:
        history_after = second.fit()
        assert second.version == 4
    finally:
        second.shutdown()
    assert resumed["done"] == 3 and resumed["version"] == 3 and resumed["data"] == stopped.data_state
    assert resumed["weights"].keys() == stopped.weights.keys()
    for name in stopped.weights:  # resharded TP=2 -> DP=2 by dist checkpointing: the same numbers
        assert torch.equal(resumed["weights"][name], stopped.weights[name]), name
    # evaluations at 0, at the end of each run (1, 3, 4) and every 2 steps
    assert set(history_after["val/reward"]) == {0, 1, 2, 3, 4}
    assert {k: history_after["val/reward"][k] for k in (0, 1, 2, 3)} == stopped.history["val/reward"]
    # keep_last=2: steps 1 and 2 were deleted once step 4 was complete
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    state = read_checkpoint_file(root / "step_00000004")
    assert state["step"] == 4 and state["driver"]["version"] == 4 and state["roles"] == ["actor"]
    rows = [json.loads(line) for line in (run_dir(stopped.dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3, 4]  # the resumed runs redid no step


def test_resumed_run_equals_the_uninterrupted_one_bitwise(tmp_path, stopped):
    """Stopped after step 1 (trainer.steps=1, then a run with steps=3: the `stopped` fixture), or killed after step
    1's checkpoint was committed, then resumed: every logged number of steps 2-3 and the final weights are those of
    the run that was never interrupted. The killed case resumes from the uninterrupted run's own step-1 checkpoint
    in a fresh process and directory: a SIGKILL after that commit leaves exactly that directory on disk (later
    steps write only new checkpoints; keep_last=0 keeps it), and nothing else of a run is read back."""
    whole = run(config(tmp_path / "whole", "trainer.steps=3"))
    expected = metric_rows(tmp_path / "whole", 1)
    assert sorted(expected) == [2, 3]

    after_kill = run(config(tmp_path / "killed", "trainer.steps=3",
                            f"trainer.resume={tmp_path / 'whole' / 'checkpoints' / 'step_00000001'}"))
    for name, got, weights in (("stop", stopped.rows, stopped.weights),
                               ("kill", metric_rows(tmp_path / "killed", 1), after_kill)):
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

