"""scripts/preprocess/{gsm8k,math}.py with verl's flags: a local copy of the dataset in its HF (parquet) or original
(jsonl/json) layout becomes verl's train.parquet and test.parquet, which megarl's prompt loader reads as they are."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.config.tiny import tiny_config
from megarl.data.files import write_records
from megarl.data.inputs import prompt_datasets
from megarl.data.preprocess import GSM8K_INSTRUCTION, MATH_INSTRUCTION, main
from megarl.models.tiny import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
GSM8K = {"train": [{"question": "Tom has 2 apples and buys 3. How many now?", "answer": "2+3=5\n#### 5"},
                   {"question": "A car costs $1,000 and a bike $200. Total?", "answer": "1000+200=1200\n#### 1,200"},
                   {"question": "Owe 4?", "answer": "#### -4"}],
         "test": [{"question": "What is 6 times 7?", "answer": "6*7=42\n#### 42"}]}
MATH = {"train": [{"problem": "Compute $1+1$.", "level": "Level 1", "type": "Algebra",
                   "solution": "First $\\boxed{1}$ is wrong; $1+1=\\boxed{2}$."},
                  {"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 2", "type": "Prealgebra",
                   "solution": "It is $\\boxed{\\frac{1}{2}}$."}],
        "test": [{"problem": "Find $x$ if $x+1=3$.", "level": "Level 1", "type": "Algebra",
                  "solution": "$x=\\boxed{2}$"}]}


def run(capsys, dataset, *argv):
    code = main(dataset, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def table(path):
    return pq.read_table(path).to_pylist()


def gsm8k_hf_layout(root: Path) -> Path:
    """openai/gsm8k as `huggingface-cli download` leaves it: main/ and socratic/ configs, one shard per split."""
    for config in ("main", "socratic"):
        for split, rows in GSM8K.items():
            socratic = [dict(r, question=f"(socratic) {r['question']}") for r in rows]
            write_records(root / config / f"{split}-00000-of-00001.parquet", rows if config == "main" else socratic)
    return root


def expected_gsm8k(split):
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{r['question']} {GSM8K_INSTRUCTION}"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": truth},
             "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, (r, truth) in enumerate(zip(GSM8K[split], {"train": ["5", "1200", "-4"], "test": ["42"]}[split]))]


def test_gsm8k_hf_layout_becomes_verls_parquet_files(tmp_path, capsys):
    raw, out = gsm8k_hf_layout(tmp_path / "raw"), tmp_path / "data" / "gsm8k"
    code, stdout, err = run(capsys, "gsm8k", "--local_dataset_path", raw, "--local_dir", out)  # verl's older flag
    assert code == 0, err
    assert f"found in {raw / 'main'}: train: train-00000-of-00001.parquet; test: test-00000-of-00001.parquet" in stdout
    assert f"wrote 3 rows to {out / 'train.parquet'}" in stdout and f"wrote 1 rows to {out / 'test.parquet'}" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]
    for split in ("train", "test"):  # column by column, the socratic config never read
        rows = table(out / f"{split}.parquet")
        assert list(rows[0]) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        for column in rows[0]:
            assert [r[column] for r in rows] == [e[column] for e in expected_gsm8k(split)], column


def test_gsm8k_jsonl_release_and_the_default_save_dir(tmp_path, capsys, monkeypatch):
    data = tmp_path / "grade-school-math" / "grade_school_math" / "data"
    for name, rows in (("train", GSM8K["train"]), ("test", GSM8K["test"]), ("train_socratic", GSM8K["test"]),
                       ("test_socratic", GSM8K["train"]), ("example_model_solutions", GSM8K["test"])):
        write_records(data / f"{name}.jsonl", rows)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # verl's default: ~/data/gsm8k
    code, stdout, err = run(capsys, "gsm8k", "--local_dataset_path", tmp_path / "grade-school-math")
    assert code == 0, err
    assert "train: grade_school_math/data/train.jsonl; test: grade_school_math/data/test.jsonl" in stdout
    out = tmp_path / "home" / "data" / "gsm8k"
    assert table(out / "train.parquet") == expected_gsm8k("train")
    assert table(out / "test.parquet") == expected_gsm8k("test")


def test_math_hf_layout_and_original_release(tmp_path, capsys):
    hf = tmp_path / "MATH-lighteval"
    for split, rows in MATH.items():
        write_records(hf / "data" / f"{split}-00000-of-00001.parquet", rows)
    original = tmp_path / "MATH"
    for split, rows in MATH.items():
        for i, row in enumerate(rows):
            path = original / split / row["type"].lower() / f"{i + 1}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(row))
    truths = {"train": ["2", "\\frac{1}{2}"], "test": ["2"]}
    for raw in (hf, original):
        out = tmp_path / f"out_{raw.name}"
        code, stdout, err = run(capsys, "math", "--local_dataset_path", raw, "--local_save_dir", out)
        assert code == 0, err
        for split, rows in MATH.items():
            written = table(out / f"{split}.parquet")
            assert [r["data_source"] for r in written] == ["DigitalLearningGmbH/MATH-lighteval"] * len(rows)
            assert [r["prompt"] for r in written] == [[{"role": "user", "content": f"{r['problem']} {MATH_INSTRUCTION}"}]
                                                      for r in rows]
            assert [r["ability"] for r in written] == ["math"] * len(rows)
            assert [r["reward_model"] for r in written] == [{"style": "rule", "ground_truth": t} for t in truths[split]]
            assert [r["extra_info"] for r in written] == [{"split": split, "index": i} for i in range(len(rows))]
            assert [(r["level"], r["type"]) for r in written] == [(r["level"], r["type"]) for r in rows]  # kept, as verl
    assert "train: data/train-00000-of-00001.parquet; test: data/test-00000-of-00001.parquet" in run(
        capsys, "math", "--local_dataset_path", hf, "--local_save_dir", tmp_path / "again")[1]


def test_without_the_dataset_it_says_what_to_download(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "gsm8k", "--local_save_dir", out)
    assert code == 2 and not out.exists()
    assert "no --local_dataset_path" in err and "openai/gsm8k, config 'main'" in err
    assert "main/train-00000-of-00001.parquet" in err and "grade_school_math/data/train.jsonl" in err
    code, _, err = run(capsys, "math", "--local_save_dir", out)
    assert code == 2 and "DigitalLearningGmbH/MATH-lighteval" in err and "MATH/train/<subject>/*.json" in err
    code, _, err = run(capsys, "math", "--local_dataset_path", tmp_path / "nowhere", "--local_save_dir", out)
    assert code == 2 and f"--local_dataset_path={tmp_path / 'nowhere'}: no such folder" in err
    # a copy without its test split: what was found, and what is missing
    write_records(tmp_path / "partial" / "train.jsonl", GSM8K["train"])
    write_records(tmp_path / "partial" / "test_socratic.jsonl", GSM8K["test"])
    code, _, err = run(capsys, "gsm8k", "--local_dataset_path", tmp_path / "partial", "--local_save_dir", out)
    assert code == 2 and not out.exists()
    assert "no test split" in err and "found train: train.jsonl; test: none among 2 .jsonl/.parquet/.json files" in err


def test_verl_flags_refused_or_mixed(tmp_path, capsys):
    code, _, err = run(capsys, "gsm8k", "--local_dataset_path", tmp_path, "--hdfs_dir", "hdfs://x/gsm8k")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--hdfs_dir=hdfs://x/gsm8k" in err
    code, _, err = run(capsys, "gsm8k", "--local_dir", tmp_path / "a", "--local_save_dir", tmp_path / "b")
    assert code == 2 and "--local_dir is verl's older name of --local_save_dir" in err
    code, _, err = run(capsys, "gsm8k", tmp_path / "in.jsonl", "--output", tmp_path / "o.jsonl",
                       "--local_save_dir", tmp_path)
    assert code == 2 and "--local_save_dir with positional inputs" in err
    code, _, err = run(capsys, "gsm8k", tmp_path / "in.jsonl")
    assert code == 2 and "positional inputs need --output" in err


def test_a_malformed_row_stops_or_is_skipped_and_keeps_the_indices(tmp_path, capsys):
    raw = tmp_path / "raw"
    write_records(raw / "train.jsonl", GSM8K["train"][:1] + [{"question": "q", "answer": "no marker"}]
                  + GSM8K["train"][1:])
    write_records(raw / "test.jsonl", GSM8K["test"])
    code, _, err = run(capsys, "gsm8k", "--local_dataset_path", raw, "--local_save_dir", tmp_path / "out")
    assert code == 1 and "train.jsonl, row 2:" in err and not (tmp_path / "out").exists()
    code, stdout, err = run(capsys, "gsm8k", "--local_dataset_path", raw, "--local_save_dir", tmp_path / "out",
                            "--skip-malformed")
    assert code == 0 and "skipped 1 malformed rows" in stdout
    # extra_info.index is the row's place in its split, the skipped row's counted
    assert [r["extra_info"]["index"] for r in table(tmp_path / "out" / "train.parquet")] == [0, 2, 3]


def test_the_script_itself(tmp_path):
    """The command line users type (math.py beside the standard library's math module)."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    for split, rows in MATH.items():
        write_records(raw / "data" / f"{split}-00000-of-00001.parquet", rows)
    done = subprocess.run([sys.executable, ROOT / "scripts/preprocess/math.py", "--local_dataset_path", raw,
                           "--local_dir", out], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [r["reward_model"]["ground_truth"] for r in table(out / "train.parquet")] == ["2", "\\frac{1}{2}"]


# a ChatML template like Qwen2.5's
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_megarl_reads_the_written_files_as_data_task(tmp_path, capsys):
    out = tmp_path / "gsm8k"
    assert run(capsys, "gsm8k", "--local_dataset_path", gsm8k_hf_layout(tmp_path / "raw"), "--local_dir", out)[0] == 0
    cfg = tiny_config([f"data.task={out / 'train.parquet'}", f"data.val_task={out / 'test.parquet'}",
                             "reward.name=gsm8k", "data.prompts_per_step=3", "data.val_size=1"])
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHATML
    prompts = prompt_datasets(cfg, tokenizer, None)
    first = next(ex for ex in prompts.train.examples if ex["answer"] == "5")
    question = GSM8K["train"][0]["question"]
    assert first["prompt"] == f"<|im_start|>user\n{question} {GSM8K_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert first["prompt_ids"] == tokenizer(first["prompt"], add_special_tokens=False)["input_ids"]
    # verl's other columns stay in the example, for rewards that read them
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["extra_info"] == {"split": "train", "index": 0, "answer": GSM8K["train"][0]["answer"],
                                   "question": question}
    assert [(ex["answer"], ex["extra_info"]["split"]) for ex in prompts.val] == [("42", "test")]
