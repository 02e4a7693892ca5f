"""metrics.jsonl of a resumed run (JsonlLogger.rewind): the steps redone after the checkpoint replace the stopped run's
rows instead of repeating them; the warm start's rows (whose step numbers overlap RL's) and the rows up to the
checkpoint stay; a row the stopped run was killed writing is cut, so the file stays valid JSON lines."""

import json

from megarl.utils.tracking import Tracker


def rows(path) -> list[tuple[int, str]]:
    """(step, first metric name) of every row."""
    return [(r["step"], [k for k in r if k != "step"][0]) for r in map(json.loads, path.read_text().splitlines())]


def test_rewind_cuts_the_steps_after_the_checkpoint_and_a_torn_row(tmp_path):
    with Tracker(str(tmp_path), ["jsonl"]) as stopped:
        for step in (1, 2, 3, 4):
            stopped.log({"sft/loss": 1.0}, step)
        for step in (0, 1, 2, 3):
            stopped.log({"train/reward": step / 10}, step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/rew')  # killed mid-row

    with Tracker(str(tmp_path), ["jsonl"]) as resumed:  # resumed from the checkpoint of RL step 2
        resumed.loggers[0].rewind(2)
        resumed.log({"train/reward": 0.33}, 3)
        resumed.log({"train/reward": 0.44}, 4)
    assert rows(tmp_path / "metrics.jsonl") == [(1, "sft/loss"), (2, "sft/loss"), (3, "sft/loss"), (4, "sft/loss"),
                                               (0, "train/reward"), (1, "train/reward"), (2, "train/reward"),
                                               (3, "train/reward"), (4, "train/reward")]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-2])["train/reward"] == 0.33


def test_rewind_without_the_step_keeps_every_whole_row(tmp_path):
    """A file the checkpoint's run did not write to (jsonl off then): nothing to match, only a torn row goes."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "a": 1}\n{"step": 8, "a"')
    with Tracker(str(tmp_path), ["jsonl"]) as resumed:
        resumed.loggers[0].rewind(2)
        resumed.log({"a": 2.0}, 3)
    assert rows(tmp_path / "metrics.jsonl") == [(7, "a"), (3, "a")]
