"""scripts/preprocess/mathematics_dataset.py: raw problems from DeepMind's mathematics_dataset become train.parquet and
test.parquet in verl's layout, disjoint, which megarl's prompt loader reads and the data_source routing scores with
the math reward. The fast tests write a recorded sample (mathematics_dataset_sample.jsonl: what the library's venv
drew for SAMPLE_ARGS); one slower test builds the venv (pip, minutes, once per machine) and checks it draws that sample
again and writes the files from the command line."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.config.tiny import tiny_config
from megarl.data.inputs import prompt_datasets
from megarl.data.preprocess import MATH_INSTRUCTION
from megarl.models.tiny import build_char_tokenizer
from megarl.rewards.data_source import scorer_of

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "preprocess" / "mathematics_dataset.py"
SAMPLE = Path(__file__).with_name("mathematics_dataset_sample.jsonl")
SAMPLE_ARGS = dict(modules=["arithmetic__add_or_sub", "arithmetic__div", "numbers__round_number"], test_modules=None,
                   train_difficulty=["train-easy"], test_difficulty="train-easy", train=4, test=2, seed=0)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def load_script():
    spec = importlib.util.spec_from_file_location("mathematics_dataset_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


def raw_sample():
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def test_the_sample_writes_disjoint_verl_layout_files(script, tmp_path):
    raw = raw_sample()
    assert script.write_splits(raw, tmp_path) == {"train": 12, "test": 6}
    tables = {split: pq.read_table(tmp_path / f"{split}.parquet").to_pylist() for split in ("train", "test")}
    for split, rows in tables.items():
        expected = [r for r in raw if r["split"] == split]
        assert [row["reward_model"] for row in rows] == [{"style": "rule", "ground_truth": r["answer"]}
                                                         for r in expected]
        assert [row["prompt"] for row in rows] == [[{"role": "user", "content": f"{r['question']} {MATH_INSTRUCTION}"}]
                                                   for r in expected]
        assert [row["extra_info"] for row in rows] == [
            {"split": split, "index": i, "module": r["module"], "difficulty": r["difficulty"],
             "question": r["question"]} for i, r in enumerate(expected)]
        assert {(row["data_source"], row["ability"]) for row in rows} == {("deepmind/math_dataset", "math")}
    questions = {split: {row["extra_info"]["question"] for row in rows} for split, rows in tables.items()}
    assert len(questions["train"]) == 12 and len(questions["test"]) == 6 and not questions["train"] & questions["test"]
    assert scorer_of("deepmind/math_dataset") == "math"  # the reward routing of a prompt file without reward.name


def test_megarl_reads_the_files_as_a_recipe_names_them(script, tmp_path):
    script.write_splits(raw_sample(), tmp_path)
    cfg = tiny_config([f"data.task={tmp_path / 'train.parquet'}", f"data.val_task={tmp_path / 'test.parquet'}",
                       "data.prompts_per_step=4", "data.val_size=6"])
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHATML
    prompts = prompt_datasets(cfg, tokenizer, None)
    held_out = sorted(r["answer"] for r in raw_sample() if r["split"] == "test")
    assert sorted(ex["answer"] for ex in prompts.val) == held_out
    first = next(ex for ex in prompts.train.examples if ex["answer"] == "-1/22")
    assert first["prompt"] == (f"<|im_start|>user\nWhat is -11 divided by 242? {MATH_INSTRUCTION}<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert first["data_source"] == "deepmind/math_dataset"


def test_a_question_in_both_splits_or_a_row_without_an_answer_is_refused(script, tmp_path):
    raw = raw_sample()
    leaked = raw + [{**raw[0], "split": "train"}]
    with pytest.raises(ValueError, match="training row 13 .*also held out: 'What is 208 \\+ 442\\?'"):
        script.write_splits(leaked, tmp_path)
    with pytest.raises(ValueError, match="raw row 3: no answer"):
        script.write_splits(raw[:2] + [{**raw[2], "answer": ""}], tmp_path)
    with pytest.raises(ValueError, match="raw row 1: split 'val' is neither train nor test"):
        script.write_splits([{**raw[0], "split": "val"}], tmp_path)
    assert not (tmp_path / "train.parquet").exists()  # nothing written from rows it refuses


def test_the_request_draws_held_out_first_each_part_seeded_by_its_name(script):
    args = argparse.Namespace(**{**SAMPLE_ARGS, "train_difficulty": ["train-easy", "train-hard"], "train": 5})
    parts = script.request_of(args)["parts"]
    assert [p["split"] for p in parts] == ["test"] * 3 + ["train"] * 6
    assert parts[3:5] == [{"split": "train", "difficulty": d, "module": "arithmetic__add_or_sub", "count": 5}
                          for d in ("train-easy", "train-hard")]
    seeds = {script.part_seed(0, p["split"], p["difficulty"], p["module"]) for p in parts}
    assert len(seeds) == len(parts) and script.part_seed(0, "test", "train-easy", "arithmetic__div") == \
        script.part_seed(0, "test", "train-easy", "arithmetic__div")


def pip_reaches_an_index(tmp_path) -> bool:
    download = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp_path),
                               "mathematics_dataset==1.0.1"], capture_output=True, timeout=300)
    return download.returncode == 0


def test_the_venv_draws_the_recorded_sample_and_the_command_writes_the_files(script, tmp_path):
    from megarl.utils.cache import cache_root

    venv = cache_root() / script.VENV_NAME
    if not (venv / ".complete").exists():  # building it takes 4-16 min on 2 cores: over the suite's budget
        if not os.environ.get("MEGARL_BUILD_VENVS"):
            pytest.skip(f"mathematics_dataset's venv is not built ({venv}); MEGARL_BUILD_VENVS=1 builds it here")
        if not pip_reaches_an_index(tmp_path / "probe"):
            pytest.skip("pip reaches no package index to build mathematics_dataset's venv (PINS: sympy 1.4, "
                        "numpy 1.23.5)")
    interpreter = script.build_venv(venv, sys.executable, None)
    assert script.sample_in_venv(interpreter, script.request_of(argparse.Namespace(**SAMPLE_ARGS))) == raw_sample()
    command = [sys.executable, str(SCRIPT), "--modules", "arithmetic__mul", "numbers__round_number", "--train", "20",
               "--test", "5", "--test-difficulty", "interpolate", "--out"]
    run = subprocess.run(command + [str(tmp_path / "a")], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert f"wrote {tmp_path / 'a'}/train.parquet (40) and {tmp_path / 'a'}/test.parquet (10)" in run.stdout
    test = pq.read_table(tmp_path / "a" / "test.parquet").to_pylist()
    assert {row["extra_info"]["difficulty"] for row in test} == {"interpolate"}
    wrong = subprocess.run([sys.executable, str(SCRIPT), "--modules", "arithmetic__mul", "--test-difficulty",
                            "extrapolate", "--out", str(tmp_path / "b")], capture_output=True, text=True, cwd=ROOT)
    assert wrong.returncode == 1 and "no module 'arithmetic__mul' at difficulty extrapolate" in wrong.stderr
    assert "arithmetic__mul_big" in wrong.stderr and not (tmp_path / "b").exists()
