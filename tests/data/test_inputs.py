"""`python -m megarl.train --dry-run` checks the model directory (config.json, tokenizer; no weights) and every
prompt, and exits 2 naming the problem; a real run stops on the same problems with the same one-line error."""

import pytest

from megarl.config.tiny import TINY_ARGS
from megarl.data.files import write_records
from megarl.models.tiny import build_tiny_model
from megarl.train import main

PROMPTS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def dry_run(capsys, *overrides):
    code = main(["--dry-run", *TINY_ARGS, "reward.name=exact_match", *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def prompt_file(tmp_path, rows, name="p.jsonl"):
    """data.task and data.val_task overrides: `rows` to train on, PROMPTS held out."""
    path, val = tmp_path / name, tmp_path / f"val_{name}"
    write_records(path, rows)
    write_records(val, PROMPTS)
    return f"data.task={path}", f"data.val_task={val}"


def test_dry_run_passes_good_inputs_and_counts_skipped_prompts(tmp_path, capsys, model_dir):
    code, out, err = dry_run(capsys, f"model.path={model_dir}", *prompt_file(tmp_path, PROMPTS))
    assert code == 0, err
    assert "prompts ok: 40 training, 40 held-out" in out
    rows = PROMPTS + [{"prompt": "caf\u00e9=", "answer": "x"}, {"prompt": "", "answer": "x"}]
    code, out, err = dry_run(capsys, f"model.path={model_dir}", *prompt_file(tmp_path, rows),
                             "data.skip_malformed=true")
    # the empty prompt (row 42) is skipped reading the file, the unencodable one (row 41) once tokenized
    assert code == 0 and "prompts ok: 40 training, 40 held-out, 2 skipped (data.skip_malformed)" in out
    assert f"\n  skipped {tmp_path / 'p.jsonl'}, row 42: field 'prompt' is empty" in out
    assert f"\n  skipped {tmp_path / 'p.jsonl'}, row 41: characters the tokenizer cannot encode" in out


def test_dry_run_names_a_model_directory_it_cannot_use(tmp_path, capsys):
    code, _, err = dry_run(capsys, f"model.path={tmp_path / 'nowhere'}")
    assert code == 2 and f"model.path={tmp_path / 'nowhere'}: no such model directory" in err
    (tmp_path / "config.json").write_text('{"max_position_embeddings": ')
    code, _, err = dry_run(capsys, f"model.path={tmp_path}")
    assert code == 2 and f"{tmp_path / 'config.json'}: not a readable JSON model config" in err
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')  # no tokenizer files
    code, _, err = dry_run(capsys, f"model.path={tmp_path}")
    assert code == 2 and "its tokenizer does not load" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_dry_run_names_a_prompt_file_that_does_not_parse(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    code, _, err = dry_run(capsys, f"data.task={path}", f"data.val_task={path}")
    assert code == 2 and f"{path}, row 2: not valid JSON" in err


def test_dry_run_names_the_limit_a_long_prompt_breaks(capsys):
    # the tiny model has 128 positions; 16 go to the response: a 121-character reversal prompt does not fit
    code, _, err = dry_run(capsys, "data.task=reverse", "data.min_len=120", "data.max_len=120",
                           "rollout.max_new_tokens=16")
    assert code == 2
    assert ("task 'reverse' train example 0: prompt is 121 tokens, over the limit of 112 (max_position_embeddings "
            "128 of the built-in tiny model - rollout.max_new_tokens 16)") in err


def test_a_run_stops_on_a_corrupt_prompt_file_before_any_worker(tmp_path, capsys, monkeypatch, model_dir):
    import ray

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)  # the run must stop before it needs a cluster
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    # what a run sets in its environment for Ray's workers, undone after the test: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    # (a local cluster on loopback) left in pytest's environment kept the launch tests' second Ray node out
    for var in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(var, "")  # records the variable's state (set or not) for the undo ...
        monkeypatch.delenv(var)  # ... and leaves it unset for the run, which sets its own
    task, val = prompt_file(tmp_path, PROMPTS, "p.parquet")
    path = tmp_path / "p.parquet"
    path.write_bytes(path.read_bytes()[:-20])  # truncated: no footer
    code = main([*TINY_ARGS, "reward.name=exact_match", f"model.path={model_dir}", task, val,
                 f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and f"input error: {path}: not a readable parquet file" in err

