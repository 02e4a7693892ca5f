"""Runs that share an output root stay apart (megarl/utils/tracking.py: <output_dir>/logs/<run id>/): TensorBoard
reads each run's scalars on their own, a resumed run's event files are cut back to the resumed step as its
metrics.jsonl is, and scripts/summarize_run.py reads one run (the newest, or one by id) of any mode."""

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from megarl.utils.tracking import Tracker, new_run_id, run_dir, run_names
from scripts.summarize_run import summarize, summary


def scalars(directory, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def log_run(root, run_id: str, rewards: list[float], val: tuple[float, float], extra: dict | None = None) -> None:
    """A run as the trainer logs it: the warm start's steps, the held-out reward before RL, RL steps, then after."""
    with Tracker(run_dir(root, run_id), ["tensorboard", "jsonl"], {"run_id": run_id}) as tracker:
        for step in (1, 2, 3):
            tracker.log({"sft/loss": 3.0 - step}, step)
        tracker.log({"val/reward": val[0]}, 0)
        for step, reward in enumerate(rewards, 1):
            tracker.log({"train/reward": reward, "timing/step": 1.0 + step, **(extra or {})}, step)
        tracker.log({"val/reward": val[1]}, len(rewards))


def test_two_runs_in_one_root_stay_apart_in_tensorboard_and_the_summary(tmp_path):
    """The quickstart, then another layout with the same output_dir: TensorBoard over the root shows two runs, each
    with its own held-out reward; summarize_run reads the newest, or the other by its id."""
    first, second = "20261206-100000-aaaa", "20261206-110000-bbbb"
    log_run(tmp_path, first, [0.1, 0.2, 0.3, 0.4, 0.5], (0.25, 0.5))
    log_run(tmp_path, second, [0.6, 0.7, 0.8], (0.125, 0.75))

    both = EventMultiplexer()
    both.AddRunsFromDirectory(str(tmp_path))
    both.Reload()
    assert sorted(both.Runs()) == [f"logs/{first}", f"logs/{second}"]
    assert [(e.step, e.value) for e in both.Scalars(f"logs/{first}", "val/reward")] == [(0, 0.25), (5, 0.5)]
    assert [(e.step, e.value) for e in both.Scalars(f"logs/{second}", "val/reward")] == [(0, 0.125), (3, 0.75)]

    newest = summarize(str(tmp_path), skip=0)
    assert newest.splitlines()[0] == str(tmp_path / "logs" / second / "metrics.jsonl")
    assert "(3 steps after 0 warm-up)" in newest and "| val/reward step 0 -> 3 | 0.125 -> 0.750 |" in newest
    older = summarize(str(tmp_path), skip=0, run_id=first)
    assert "(5 steps after 0 warm-up)" in older and "| val/reward step 0 -> 5 | 0.250 -> 0.500 |" in older
    assert "| timing/step | 4 |" in older  # the median of 2..6
    as_json = summary(str(tmp_path), skip=0, run_id=first)  # what --json prints, and docs/results/ records
    assert as_json["val_reward"] == {"first": {"step": 0, "reward": 0.25}, "last": {"step": 5, "reward": 0.5}}
    assert as_json["median"]["timing/step"] == {"median": 4, "steps": 5} and as_json["steps"] == 5
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl for run nope"):
        summarize(str(tmp_path), run_id="nope")
    with pytest.raises(FileNotFoundError, match="holds no run's logs"):
        summarize(str(tmp_path / "logs" / first / "missing"))


def test_a_resumed_run_continues_its_own_events_one_value_per_step(tmp_path):
    """Killed after step 4 (its last record half-written), resumed from the checkpoint of step 2: the redone steps
    3 and 4 replace the stopped run's in TensorBoard as in metrics.jsonl; the warm start's steps 1-3, whose numbers
    overlap RL's, and the held-out reward before RL stay; the events are one file, then the resumed process's."""
    directory = run_dir(tmp_path, new_run_id())
    tracker = Tracker(directory, ["tensorboard", "jsonl"], {"trainer": {"steps": 4}})
    for step in (1, 2, 3):
        tracker.log({"sft/loss": 3.0 - step}, step)
    tracker.log({"val/reward": 0.25}, 0)
    for step in (1, 2, 3, 4):
        tracker.log({"train/reward": step / 10}, step)
    tracker.close()
    [stopped] = directory.glob("*tfevents*")
    with open(stopped, "ab") as f:  # a record cut short by the kill: its length says 60 bytes, 5 follow
        f.write((60).to_bytes(8, "little") + b"\0" * 9)

    resumed = Tracker(directory, ["tensorboard", "jsonl"], {"trainer": {"steps": 4}})
    resumed.rewind(2)
    for step in (3, 4):
        resumed.log({"train/reward": step / 10 + 0.5}, step)
    resumed.log({"val/reward": 0.75}, 4)
    resumed.close()

    assert scalars(directory, "train/reward") == [(1, 0.1), (2, 0.2), (3, 0.8), (4, 0.9)]
    assert scalars(directory, "sft/loss") == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert scalars(directory, "val/reward") == [(0, 0.25), (4, 0.75)]
    events = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    events.Reload()
    assert len(events.Tensors("config/text_summary")) == 1  # the run's config, once
    assert len(list(directory.glob("*tfevents*"))) == 2 and stopped.exists()  # the cut file kept its name
    assert not list(directory.glob(".events*"))
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("train/reward")) for r in rows if "train/reward" in r] == [(1, 0.1), (2, 0.2),
                                                                                          (3, 0.8), (4, 0.9)]


def test_an_async_runs_metrics_summarize(tmp_path):
    """An async run's first step has no pause (nothing in flight yet) and an over-sampled step adds keys: each phase's
    median is over the steps that timed it, and the table says how many those were."""
    directory = run_dir(tmp_path, new_run_id())
    with Tracker(directory, ["jsonl"]) as tracker:
        tracker.log({"val/reward": 0.5}, 0)
        tracker.log({"timing/step": 3.0, "timing/wait": 1.0, "perf/tokens_per_s": 100.0, "async/staleness": 0.0}, 1)
        for step, pause in ((2, 0.25), (3, 0.5), (4, 0.75)):
            tracker.log({"timing/step": 2.0, "timing/wait": 0.5, "timing/pause": pause, "perf/tokens_per_s": 150.0,
                         "async/staleness": 1.0}, step)
        tracker.log({"val/reward": 0.625}, 4)
    table = summarize(str(directory / "metrics.jsonl"), skip=1).splitlines()
    assert "| timing/pause | 0.5 |" in table and "| timing/step | 2 |" in table  # all 3 steps after the first
    table = summarize(str(directory), skip=0).splitlines()
    assert "| timing/pause (3 steps) | 0.5 |" in table and "| timing/step | 2 |" in table
    assert "| perf/tokens_per_s | 150 |" in table and "| val/reward step 0 -> 4 | 0.500 -> 0.625 |" in table


def test_trackers_name_runs_apart_and_ids_sort_by_start(tmp_path):
    config = {"run_id": "20261206-100000-aaaa", "trainer": {"output_dir": str(tmp_path / "quickstart")}}
    assert run_names(str(tmp_path / "x"), config) == ("megarl", "quickstart-20261206-100000-aaaa")
    config["trainer"] |= {"project_name": "p", "experiment_name": "tp2pp2"}
    assert run_names(str(tmp_path / "x"), config) == ("p", "tp2pp2-20261206-100000-aaaa")
    assert run_names(str(tmp_path / "x"), {"trainer": {"experiment_name": "e"}}) == ("megarl", "e")  # no run id
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", new_run_id())
    for i in ("20261206-230000-ffff", "20261207-000001-0000", "20261206-235959-9999"):
        run_dir(tmp_path, i).mkdir(parents=True)
    assert run_dir(tmp_path).name == "20261207-000001-0000"
    assert run_dir(tmp_path, "x") == tmp_path / "logs" / "x"
