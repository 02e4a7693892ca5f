"""A resume through `python -m megarl.train`'s main on CPU (the quickstart recipe, tiny): the newest checkpoint,
damaged after its commit, is named and skipped; the run resumes from the one before, redoes the step, and
metrics.jsonl holds each RL step once; the damaged checkpoint is written again, whole."""

import json

from megarl.engine.checkpoint_dir import checkpoint_damage
from megarl.train import main
from megarl.utils.tracking import run_dir

from tests.conftest import QUICKSTART


def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one(tmp_path, capsys):
    args = ["--config", str(QUICKSTART), f"trainer.output_dir={tmp_path}", "actor.parallel.world_size=1",
            "actor.parallel.tp=1", "model.tiny_num_layers=1", "sft.steps=0", "data.prompts_per_step=2",
            "rollout.n_samples=2", "data.val_size=2", "rollout.eval_n_samples=1", "rollout.max_new_tokens=4",
            "trainer.eval_every=0", "trainer.save_every=1", "trainer.keep_last=0", "trainer.loggers=jsonl"]
    assert main(args + ["trainer.steps=2"]) == 0
    newest = tmp_path / "checkpoints" / "step_00000002"
    shard = sorted((newest / "actor" / "state").glob("*.distcp"))[0]
    shard.write_bytes(bytes(shard.stat().st_size))
    capsys.readouterr()

    assert main(args + ["trainer.steps=2"]) == 0  # step 1 resumed, step 2 redone
    out = capsys.readouterr().out
    named = f"{newest}: {shard.relative_to(newest)}: contents differ from the manifest"
    assert named in out and "zero-filled" in out.split(named)[1].splitlines()[0]
    assert f"resumed from {tmp_path}/checkpoints/step_00000001 after step 1" in out
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2]  # step 2 redone: its row replaced
    assert checkpoint_damage(newest, "full") == []  # written again by the resumed run
    assert (tmp_path / "run.lock").read_text() == ""
