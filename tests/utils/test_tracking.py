import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.config import ConfigError
from megarl.utils.tracking import Tracker

STEP1 = {"train/reward": 0.5123, "val/reward": 0.6, "train/kl": 0.00123, "train/entropy": 1.234,
         "train/response_length": 12.5, "timing/step": 3.214, "perf/tokens_per_s": 1520.4, "train/clipfrac": 0.1,
         "timing/generate": 1.5}
STEP2 = {"train/reward": 0.75, "timing/step": 2.0, "timing/generate": 1.25}


def test_console_line_shows_the_headline_metrics_present(tmp_path, capsys):
    with Tracker(str(tmp_path), ["console"]) as tracker:
        tracker.log(STEP1, step=1)
        tracker.log(STEP2, step=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 1 | reward 0.5123 | val 0.6 | kl 0.00123 | entropy 1.234 | len 12.5 | 3.21s | 1520 tok/s",
                     "step 2 | reward 0.75 | 2s"]


def test_tensorboard_event_file_holds_scalars_and_config(tmp_path):
    config = {"algorithm": {"kl_coef": 0.0, "advantage": "grpo"}, "trainer": {"steps": 2}}
    tracker = Tracker(str(tmp_path), ["tensorboard"], config)
    tracker.log(STEP1, step=1)
    tracker.log({**STEP2, "train/grad_norm": torch.tensor(0.25)}, step=2)
    tracker.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(STEP1) | {"train/grad_norm"}
    reward = [(e.step, e.value) for e in events.Scalars("train/reward")]
    assert reward == [(1, pytest.approx(0.5123)), (2, pytest.approx(0.75))]
    assert [(e.step, e.value) for e in events.Scalars("timing/generate")] == [(1, 1.5), (2, 1.25)]
    assert [(e.step, e.value) for e in events.Scalars("train/grad_norm")] == [(2, 0.25)]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "kl_coef: 0.0" in text and "advantage: grpo" in text


def test_jsonl_rows_one_per_log_call(tmp_path):
    with Tracker(str(tmp_path / "run"), ["jsonl"]) as tracker:  # creates the output directory
        tracker.log(STEP1, step=1)
        tracker.log({"val/reward": torch.tensor([0.875])}, step=2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, **STEP1}, {"step": 2, "val/reward": 0.875}]


def test_unknown_logger_and_non_numeric_metric_are_named(tmp_path):
    with pytest.raises(ConfigError, match="trainer.loggers: unknown logger 'tensorbord'; did you mean 'tensorboard'"):
        Tracker(str(tmp_path), ["jsonl", "tensorbord"])
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing opened before the error
    with Tracker(str(tmp_path), ["jsonl"]) as tracker:
        with pytest.raises(TypeError, match="metric 'train/sample' must be a number, got str"):
            tracker.log({"train/sample": "hello"}, step=0)
        with pytest.raises(TypeError, match="metric 'train/lengths' must be a number, got Tensor"):
            tracker.log({"train/lengths": torch.tensor([1.0, 2.0])}, step=0)
