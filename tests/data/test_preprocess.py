import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.data.dataset import load_prompt_file
from megarl.data.files import write_records
from megarl.data.preprocess import GSM8K_INSTRUCTION, convert, gsm8k_record, last_boxed, math_record
from megarl.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[2]
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A house costs $1,200 more than a car that costs $3,400. What does the house cost?",
     "answer": "3400 + 1200 = 4600\n#### 4,600"},
]


def test_gsm8k_rows_become_prompts_the_reward_accepts():
    first = gsm8k_record(GSM8K_ROWS[0])
    assert first["answer"] == "72" and first["prompt"].endswith(GSM8K_INSTRUCTION)
    assert gsm8k_record(GSM8K_ROWS[1])["answer"] == "4600"
    assert get_reward_fn("gsm8k")("48 + 24 = 72\n#### 72", first["answer"], {}) == 1.0
    with pytest.raises(ValueError, match="'#### <number>'"):
        gsm8k_record({"question": "q", "answer": "no marker"})
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_record({"question": "q", "answer": "#### seventy"})


@pytest.mark.parametrize("solution, boxed", [
    ("So $x=\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("First \\boxed{1}, finally \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),       # the last box, nested braces
    ("\\fbox{5}", "5"),
    ("\\boxed 7.", "7"),
    ("\\boxed{\\frac{1}{2}", None),                                        # unbalanced
    ("no box", None),
])
def test_last_boxed(solution, boxed):
    assert last_boxed(solution) == boxed


def test_math_json_folder_with_a_malformed_file(tmp_path):
    folder = tmp_path / "MATH" / "train" / "algebra"
    folder.mkdir(parents=True)
    (folder / "1.json").write_text(json.dumps({"problem": "Compute $\\frac{2}{4}$.", "level": "Level 1",
                                               "type": "Algebra", "solution": "$\\boxed{\\frac{1}{2}}$"}))
    (folder / "2.json").write_text(json.dumps({"problem": "Broken.", "solution": "no answer"}))
    (folder / "3.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"algebra/2.json, row 1: the solution has no complete"):
        convert([str(tmp_path / "MATH")], math_record)
    rows, skipped = convert([str(tmp_path / "MATH")], math_record, skip_malformed=True)
    assert [r["answer"] for r in rows] == ["\\frac{1}{2}"] and rows[0]["level"] == "Level 1"
    assert [(Path(e.path).name, e.row) for e in skipped] == [("2.json", 1), ("3.json", 1)]
    # MATH-500 rows carry their answer
    assert math_record({"problem": "p", "solution": "\\boxed{1}", "answer": "2"})["answer"] == "2"


def test_command_lines(tmp_path):
    raw = tmp_path / "train.parquet"
    write_records(raw, GSM8K_ROWS + [{"question": "q", "answer": "no marker"}])
    out = tmp_path / "gsm8k" / "train.jsonl"
    run = subprocess.run([sys.executable, ROOT / "scripts/preprocess/gsm8k.py", raw, "--output", out],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "train.parquet, row 3:" in run.stderr and not out.exists()
    run = subprocess.run([sys.executable, ROOT / "scripts/preprocess/gsm8k.py", raw, "--output", out,
                          "--skip-malformed"], capture_output=True, text=True)
    assert run.returncode == 0 and "wrote 2 rows" in run.stdout and "skipped 1 malformed" in run.stdout
    assert [e["answer"] for e in load_prompt_file(out)] == ["72", "4600"]
    # scripts/preprocess/math.py shares its name with the standard library's math module
    raw_math = tmp_path / "math.jsonl"
    write_records(raw_math, [{"problem": "p", "solution": "\\boxed{3}"}])
    run = subprocess.run([sys.executable, ROOT / "scripts/preprocess/math.py", raw_math, "--output",
                          tmp_path / "m.parquet"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert load_prompt_file(tmp_path / "m.parquet")[0]["answer"] == "3"
