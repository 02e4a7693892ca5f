"""Every path a run's config names is checked before Ray starts, each problem naming its key, all at once: the RL
run's (python -m megarl.train) and the reward model's (python -m megarl.train_rm)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megarl.rm_trainer
import megarl.train
from megarl.config.tiny import TINY_RUN, tiny_config
from megarl.data.run_paths import path_problems, rm_path_problems, unwritable
from megarl.train import main
from megarl.train_rm import main as train_rm_main

REPO = Path(megarl.train.__file__).parents[1]


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


def test_reward_model_training_names_its_missing_inputs_and_blocked_outputs_by_key(tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "pairs.jsonl").mkdir()
    cfg = tiny_config([f"preference.train={tmp_path / 'pairs.jsonl'}", f"preference.val={tmp_path / 'val.jsonl'}",
                       f"model.path={tmp_path / 'base'}", f"trainer.output_dir={tmp_path / 'a_file' / 'run'}",
                       f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", f"reward_model.path={tmp_path / 'a_file'}"])
    assert rm_path_problems(cfg) == [
        f"preference.train={tmp_path / 'pairs.jsonl'}: a directory, not a file",
        f"preference.val={tmp_path / 'val.jsonl'}: no such file",
        f"model.path={tmp_path / 'base'}: no such model directory",
        f"trainer.output_dir={tmp_path / 'a_file' / 'run'}: {tmp_path / 'a_file'} is a file, not a directory",
        f"reward_model.path={tmp_path / 'a_file'}: a file, not a directory"]
    # a built-in task names no file, the built-in tiny model no directory; reward_model.path is written, not read
    assert rm_path_problems(tiny_config(["preference.train=reverse", "model.path=tiny",
                                         f"reward_model.path={tmp_path / 'new' / 'rm'}"])) == []


def test_an_input_this_user_cannot_read_is_named(tmp_path):
    """Checked in a process without root's override of file permissions where the tests run as root."""
    (tmp_path / "pairs.jsonl").write_text("{}\n")
    (tmp_path / "pairs.jsonl").chmod(0o200)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "config.json").chmod(0o200)
    tmp_path.chmod(0o555)  # nothing can be made in it
    check = ("from megarl.config.tiny import tiny_config; from megarl.data.run_paths import rm_path_problems; "
             f"print(rm_path_problems(tiny_config(['preference.train={tmp_path / 'pairs.jsonl'}', "
             f"'model.path={tmp_path / 'model'}', 'trainer.output_dir={tmp_path / 'out'}'])))")
    command = [sys.executable, "-c", check]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root reads any file, and setpriv (util-linux), which takes that from a process, is missing")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] + command
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    finally:
        tmp_path.chmod(0o755)
    assert out.stdout.strip() == str([f"preference.train={tmp_path / 'pairs.jsonl'}: not readable by this user",
                                      f"model.path={tmp_path / 'model'}: its config.json is not readable by this user",
                                      f"trainer.output_dir={tmp_path / 'out'}: {tmp_path} is not writable by this "
                                      "user"]), out.stderr


def test_train_rm_names_them_before_ray(tmp_path, capsys, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("reached past the path check")

    monkeypatch.setattr(megarl.train, "start_ray", must_not_run)
    monkeypatch.setattr(megarl.rm_trainer, "check_rm_inputs", must_not_run)
    args = ["model.path=tiny", "trainer.steps=2", "trainer.device=cpu", f"trainer.output_dir={tmp_path}",
            f"preference.train={tmp_path / 'pairs.jsonl'}"]
    for dry_run in ([], ["--dry-run"]):
        assert train_rm_main(dry_run + args) == 2
        assert capsys.readouterr().err.strip() == (f"input error: preference.train={tmp_path / 'pairs.jsonl'}: no "
                                                   "such file")


def test_a_verl_command_hears_of_a_hub_id_and_of_the_verl_key_it_typed(tmp_path, capsys, monkeypatch):
    """A model named as verl users name them (a hub id) is not downloaded: the run says so and how to fetch it,
    and each problem names the verl key the user typed, not only the megarl key it became."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(megarl.train, "start_ray", lambda *a, **k: pytest.fail("reached past the path check"))
    code = main(["--dry-run", "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "trainer.device=cpu",
                 "data.train_files=data/train.parquet", "data.val_files=data/test.parquet"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("model.path=Qwen/Qwen2-7B-Instruct: no such local directory ('Qwen/Qwen2-7B-Instruct' reads as a Hugging "
            "Face hub id, and megarl does not download models: fetch it first with huggingface-cli download "
            "Qwen/Qwen2-7B-Instruct --local-dir <dir>, then name <dir>) (set by verl's "
            "actor_rollout_ref.model.path='Qwen/Qwen2-7B-Instruct')") in err
    assert ("data.task=data/train.parquet: no such prompt file (set by verl's data.train_files='data/train.parquet')"
            in err)
    # --check-config needs no model: a warning, the same words
    assert main(["--check-config", "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "trainer.device=cpu"]) == 0
    assert ("warning: model.path=Qwen/Qwen2-7B-Instruct: no such local directory ('Qwen/Qwen2-7B-Instruct' reads as a "
            "Hugging Face hub id") in capsys.readouterr().out
    # a local path that is not there is not taken for a hub id
    assert path_problems(tiny_config(["model.path=./models/qwen"])) == ["model.path=./models/qwen: no such model "
                                                                        "directory"]


def test_a_checkpoint_to_resume_that_is_not_there_is_named_with_the_dry_runs_problems(tmp_path):
    missing = tmp_path / "checkpoints" / "step_00000010"
    assert path_problems(tiny_config([f"trainer.resume={missing}"])) == [
        f"trainer.resume={missing}: no such checkpoint (or directory of checkpoints)"]
    missing.mkdir(parents=True)  # what it holds is resume.py's to check, when the run starts
    assert path_problems(tiny_config([f"trainer.resume={missing}"])) == []
    assert path_problems(tiny_config(["trainer.resume=force"])) == []
