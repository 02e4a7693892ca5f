"""Every path a run's config names is checked before Ray starts, each problem naming its key, all at once."""

import megarl.train
from megarl.config.tiny import TINY_RUN, tiny_config
from megarl.data.run_paths import path_problems, unwritable
from megarl.train import main


def test_each_missing_input_and_blocked_output_is_named_by_its_key(tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "model").mkdir()  # a directory without config.json
    cfg = tiny_config([f"data.task={tmp_path / 'train.jsonl'}", f"data.val_task={tmp_path / 'val.parquet'}",
                       f"sft.data={tmp_path / 'traces.jsonl'}", f"model.path={tmp_path / 'model'}",
                       "algorithm.advantage=gae", f"critic.path={tmp_path / 'critic'}",
                       f"reward_model.path={tmp_path / 'rm'}", f"trainer.output_dir={tmp_path / 'a_file' / 'run'}",
                       f"trainer.checkpoint_dir={tmp_path / 'a_file'}", f"rollout.replay_dir={tmp_path / 'dumps'}"])
    assert path_problems(cfg) == [
        f"data.task={tmp_path / 'train.jsonl'}: no such prompt file",
        f"data.val_task={tmp_path / 'val.parquet'}: no such prompt file",
        f"sft.data={tmp_path / 'traces.jsonl'}: no such file",
        f"model.path={tmp_path / 'model'}: no config.json there (a HF model directory has one)",
        f"critic.path={tmp_path / 'critic'}: no such model directory",
        f"reward_model.path={tmp_path / 'rm'}: no such model directory",
        f"rollout.replay_dir={tmp_path / 'dumps'}: no such directory",
        f"trainer.output_dir={tmp_path / 'a_file' / 'run'}: {tmp_path / 'a_file'} is a file, not a directory",
        f"trainer.checkpoint_dir={tmp_path / 'a_file'}: a file, not a directory"]
    # what a run can make is no problem: a directory several levels below an existing one
    assert path_problems(tiny_config([f"trainer.output_dir={tmp_path / 'new' / 'deeper' / 'run'}"])) == []
    assert unwritable(str(tmp_path)) is None


def test_a_run_names_them_before_ray_or_the_run_lock(tmp_path, capsys, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("reached past the path check")

    monkeypatch.setattr(megarl.train, "start_ray", must_not_run)
    monkeypatch.setattr("megarl.resume.claim_run", must_not_run)
    args = [f"{k}={v}" for k, v in TINY_RUN.items() if k != "data.task"]
    bad = [f"data.task={tmp_path / 'p.jsonl'}", f"trainer.output_dir={tmp_path}", "reward.name=exact_match"]
    (tmp_path / "model").write_text("")
    for dry_run in ([], ["--dry-run"]):
        assert main(dry_run + args + bad + [f"trainer.checkpoint_dir={tmp_path / 'model' / 'ckpt'}"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == (f"input error: data.task={tmp_path / 'p.jsonl'}: no such prompt file; "
                               f"trainer.checkpoint_dir={tmp_path / 'model' / 'ckpt'}: {tmp_path / 'model'} is a "
                               "file, not a directory")
