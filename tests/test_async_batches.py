"""async.batches_at_once (megarl/async_trainer.py, megarl/rollout_buffer.py): the rollout thread generates the
step-batches the buffer admits at once in one engine call (the agent loop's too); each is admitted, put and trained
within its own bound, in the order its prompts were drawn, also across a kill and resume; DAPO dynamic sampling and
over-sampling generate one step-batch a call."""

import torch

import megarl.sampler
from megarl.async_trainer import AsyncRLTrainer, RolloutLoop
from megarl.config.tiny import tiny_config
from megarl.protocol import Batch
from megarl.rollout_buffer import RolloutBuffer, prompt_record, split_groups
from megarl.sampler import AsyncSampler
from megarl.utils.timers import Timers

from tests.test_async import begin, config, run
from tests.test_async_agent import RECIPE, shrunk_recipe


def test_the_buffer_begins_what_it_admits_at_once():
    buffer = RolloutBuffer(groups_per_step=1, max_staleness=2, buffer_batches=0, stale="drop", steps=10)
    # from version 0: batches 1-3 would be trained at versions 0-2, within the bound; batch 4 (at 3) would not
    assert begin(buffer, most=5) == ([(1, 0), (2, 1), (3, 2)], 0)
    assert not buffer.admits()
    for number in (1, 2, 3):
        buffer.put_batch(number, Batch({"policy_version": torch.tensor([0])}, {"group": [0]}), {})
    buffer.take(version=0)
    buffer.publish(1)
    assert begin(buffer, most=5) == ([(4, 3)], 1)
    # at most `most`, at most async.buffer_batches ahead, and none past the run's steps
    assert begin(RolloutBuffer(1, 4, 0, "drop", 10), most=2)[0] == [(1, 0), (2, 1)]
    assert begin(RolloutBuffer(1, 4, 2, "drop", 10), most=5)[0] == [(1, 0), (2, 1)]
    assert begin(RolloutBuffer(1, 4, 0, "drop", steps=3), most=5)[0] == [(1, 0), (2, 1), (3, 2)]
    # 0 (the default): all the buffer admits, max_staleness + 1 ahead from version 0
    assert begin(RolloutBuffer(1, 2, 0, "drop", 10), most=0)[0] == [(1, 0), (2, 1), (3, 2)]
    # at max_staleness 0 one at a time, whatever batches_at_once says (async is then the synchronous loop)
    assert begin(RolloutBuffer(1, 0, 0, "drop", 10), most=5)[0] == [(1, 0)]


def record_run(monkeypatch, cfg) -> tuple[dict, list[list], dict[int, list]]:
    """run(cfg), recording the rollout engine's calls (each call's prompts) and each step's trained prompts (by
    group, in order)."""
    calls, trained = [], {}
    stream, train_step = megarl.sampler.stream_rollout, AsyncRLTrainer.train_step

    def recording_stream(rollout, method, *args, **kwargs):
        calls.append([p["prompt_ids"] if isinstance(p, dict) else p for p in args[0]])  # (the agent loop's: dicts)
        return stream(rollout, method, *args, **kwargs)

    def recording_train_step(self, batch, metrics, start):
        trained[self.version + 1] = [prompt_record(g)["prompt_ids"] for g in split_groups(batch)]
        return train_step(self, batch, metrics, start)
    monkeypatch.setattr(megarl.sampler, "stream_rollout", recording_stream)
    monkeypatch.setattr(AsyncRLTrainer, "train_step", recording_train_step)
    return run(cfg), calls, trained


def test_batches_admitted_together_are_generated_in_one_call_within_the_bound(tmp_path, ray_local, monkeypatch):
    # async.max_staleness=1 admits 2 step-batches (2 prompts each) ahead from version 0: the first call makes both
    together = ("trainer.mode=async", "async.max_staleness=1", "async.batches_at_once=2", "trainer.steps=4",
                "trainer.eval_every=4", "trainer.save_every=2")
    rows, calls, trained = record_run(monkeypatch, config(tmp_path / "whole", *together))
    assert sorted(rows) == [0, 1, 2, 3, 4] and len(calls[0]) == 4
    assert [rows[s]["async/batches_at_once"] for s in (1, 2)] == [2, 2]
    assert [rows[s]["async/rollout_version"] for s in (1, 2)] == [0, 0]
    drawn = [p for call in calls for p in call]
    assert len(drawn) == 8 and max(len(call) for call in calls) <= 4  # no batch generated twice, none dropped
    # each step trains one step-batch, its prompts in the order they were drawn
    assert [trained[s] for s in (1, 2, 3, 4)] == [drawn[0:2], drawn[2:4], drawn[4:6], drawn[6:8]]
    for step in (1, 2, 3, 4):  # (the trainer also checks every row against the bound before training on it)
        assert rows[step]["async/staleness_max"] <= 1 and rows[step]["async/stale_dropped"] == 0, step
        assert rows[step]["async/staleness_0"] + rows[step]["async/staleness_1"] == 8, step

    # killed after step 2's checkpoint: the resumed run trains the same prompts at steps 3 and 4, within the bound
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    resumed, _, trained_again = record_run(monkeypatch, config(tmp_path / "killed", *together,
                                                               f"trainer.resume={step2}", "trainer.save_every=0"))
    assert sorted(resumed) == [3, 4]
    assert [trained_again[s] for s in (3, 4)] == [trained[3], trained[4]]
    for step in (3, 4):
        assert resumed[step]["async/staleness_max"] <= 1 and resumed[step]["async/stale_dropped"] == 0, step


def test_the_agent_loop_runs_batches_admitted_together_in_one_call(tmp_path, ray_local, monkeypatch):
    rows, calls, trained = record_run(monkeypatch, shrunk_recipe(tmp_path, "async.batches_at_once=2"))
    assert [len(call) for call in calls] == [4]  # both step-batches' conversations in one rollout_agent_groups call
    assert [trained[s] for s in (1, 2)] == [calls[0][0:2], calls[0][2:4]]
    assert [rows[s]["async/batches_at_once"] for s in (1, 2)] == [2, 2]
    assert [rows[s]["async/staleness_max"] for s in (1, 2)] == [0, 1]  # both from version 0


def test_dynamic_sampling_and_over_sampling_generate_one_batch_at_a_time(capsys):
    for overrides in (["algorithm.dynamic_sampling=true"], ["agent.oversample_groups=2"], []):
        cfg = tiny_config(["trainer.mode=async", "async.max_staleness=3", "async.batches_at_once=4",
                                   *overrides], path=RECIPE)
        loop = RolloutLoop(AsyncSampler(cfg, None, None, None, None, Timers()), RolloutBuffer(1, 3, 0, "drop", 10))
        assert loop.batches_at_once == (4 if not overrides else 1), overrides
    assert capsys.readouterr().out.count("async.batches_at_once=4: 1 with DAPO dynamic sampling or over-sampling") == 2
