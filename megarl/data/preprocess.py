"""Turning the public GSM8K and MATH files into prompt files ({'prompt', 'answer', ...} per row).

Used by scripts/preprocess/gsm8k.py and scripts/preprocess/math.py (thin command lines over `main`).

  GSM8K   rows {'question', 'answer'} (the .jsonl of the original release, or the parquet of its
          mirrors); the reference is the number after the solution's final `#### `.
  MATH    rows {'problem', 'solution', 'level', 'type'} (the original release: one .json file per
          problem, in a folder per subject; or .jsonl/.parquet mirrors). The reference is the row's
          'answer' when it has one (MATH-500), else the content of the solution's last \\boxed{}.

The prompt is the question followed by the instruction the reward expects (`####` for the gsm8k reward,
`\\boxed{}` for the math reward); recipes apply the model's chat template on top (data.chat_template).
A malformed row stops the conversion with an error naming the file and row, or, with
--skip-malformed, is skipped and counted.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

from megarl.data.files import SUFFIXES, MalformedRow, iter_records, write_records
from megarl.rewards.gsm8k import to_decimal

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def gsm8k_record(record: dict) -> dict:
    question, solution = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"field 'question' must be a non-empty string, got {question!r}")
    if not isinstance(solution, str) or "####" not in solution:
        raise ValueError(f"field 'answer' must be a solution ending in '#### <number>', got {solution!r}")
    final = solution.rsplit("####", 1)[1].strip()
    if to_decimal(final) is None:
        raise ValueError(f"the final answer after '####' is not a number: {final!r}")
    return {"prompt": f"{question.strip()} {GSM8K_INSTRUCTION}", "answer": final.replace(",", "")}


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed"):] if rest.startswith("\\boxed") else rest[len("\\fbox"):]
    if rest.startswith(" "):  # "\boxed 5": the argument is one token
        token = rest.strip().split()
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced braces


def math_record(record: dict) -> dict:
    problem = record.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"field 'problem' must be a non-empty string, got {problem!r}")
    answer = record.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        solution = record.get("solution")
        if not isinstance(solution, str):
            raise ValueError("the row has neither an 'answer' nor a 'solution' string")
        answer = last_boxed(solution)
        if not answer or not answer.strip():
            raise ValueError("the solution has no complete \\boxed{...} answer")
    out = {"prompt": f"{problem.strip()} {MATH_INSTRUCTION}", "answer": answer.strip()}
    for key in ("level", "type", "subject", "unique_id"):
        if key in record:
            out[key] = record[key]
    return out


def input_files(paths: list[str]) -> list[Path]:
    """The record files among `paths`, folders searched recursively, in sorted order."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise FileNotFoundError(f"{path}: no {', '.join(SUFFIXES)} files in this folder")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"input not found: {path}")
    return files


def convert(paths: list[str], make_record: Callable[[dict], dict],
            skip_malformed: bool = False) -> tuple[list[dict], list[MalformedRow]]:
    """(converted rows, skipped rows) of every input file; without skip_malformed the first bad row raises."""
    rows, skipped = [], []
    for path in input_files(paths):
        for row, record in iter_records(path):
            try:
                if isinstance(record, MalformedRow):
                    raise record
                rows.append(make_record(record))
            except ValueError as e:
                error = e if isinstance(e, MalformedRow) else MalformedRow(path, row, str(e))
                if not skip_malformed:
                    raise error from None
                skipped.append(error)
    return rows, skipped


DATASETS = {"gsm8k": gsm8k_record, "math": math_record}


def main(dataset: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"scripts/preprocess/{dataset}.py",
                                     description=f"Convert {dataset} files into a megarl prompt file.")
    parser.add_argument("inputs", nargs="+", help="input files (.jsonl, .parquet, .json) or folders of them")
    parser.add_argument("--output", required=True, help="the prompt file to write (.jsonl or .parquet)")
    parser.add_argument("--skip-malformed", action="store_true", help="skip and count bad rows instead of stopping")
    args = parser.parse_args(argv)
    try:
        rows, skipped = convert(args.inputs, DATASETS[dataset], args.skip_malformed)
        if not rows:
            raise ValueError(f"no rows converted from {', '.join(args.inputs)}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write_records(args.output, rows)
    print(f"wrote {len(rows)} rows to {args.output}; skipped {len(skipped)} malformed rows")
    for error in skipped[:5]:
        print(f"  skipped {error}")
    return 0
