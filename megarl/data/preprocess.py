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

verl's layout (scripts/preprocess/*.py without positional inputs; verl's examples/data_preprocess/gsm8k.py and
math_dataset.py): --local_dataset_path is a downloaded copy of the dataset (this script downloads nothing), whose
train and test splits are found by file name; --local_save_dir (or verl's older --local_dir) receives
train.parquet and test.parquet, one row per problem as verl writes them:

  data_source    "openai/gsm8k" | "DigitalLearningGmbH/MATH-lighteval"
  prompt         [{"role": "user", "content": question + " " + instruction}]
  ability        "math"
  reward_model   {"style": "rule", "ground_truth": the reference above}
  extra_info     {"split", "index"} (the row's 0-based place in its split), GSM8K's also {"answer", "question"}
                 (the raw solution and question); MATH keeps its rows' other columns (level, type) beside these

megarl reads these files as they are (data.task=<dir>/train.parquet data.val_task=<dir>/test.parquet): the
prompt is rendered with the model's chat template, the answer is reward_model.ground_truth.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
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
    return convert_files(input_files(paths), lambda record, _: make_record(record), skip_malformed)


def convert_files(files: list[Path], make_record: Callable[[dict, int], dict],
                  skip_malformed: bool = False) -> tuple[list[dict], list[MalformedRow]]:
    """convert's rows from `files`; make_record(record, index) gets each row's 0-based place among all of
    them, malformed rows counted too (so an index names the same source row with or without skips)."""
    rows, skipped = [], []
    for index, (path, row, record) in enumerate((path, row, record) for path in files
                                                for row, record in iter_records(path)):
        try:
            if isinstance(record, MalformedRow):
                raise record
            rows.append(make_record(record, index))
        except ValueError as e:
            error = e if isinstance(e, MalformedRow) else MalformedRow(path, row, str(e))
            if not skip_malformed:
                raise error from None
            skipped.append(error)
    return rows, skipped


DATASETS = {"gsm8k": gsm8k_record, "math": math_record}
SPLITS = ("train", "test")


@dataclass(frozen=True)
class VerlSource:
    """A dataset as verl's preprocessing script takes it: its HF name (the rows' data_source), where verl saves it,
    the HF dataset's folder of the config verl loads, what to download, and the raw fields verl keeps in
    extra_info."""
    data_source: str
    save_dir: str
    config_dir: str
    download: str
    raw_in_extra_info: tuple[str, ...] = ()
    other_configs: tuple[str, ...] = ()  # folders of the HF dataset's other configs, never read


VERL = {
    "gsm8k": VerlSource(
        "openai/gsm8k", "~/data/gsm8k", "main",
        "  the HF dataset openai/gsm8k, config 'main': main/train-00000-of-00001.parquet and "
        "main/test-00000-of-00001.parquet\n"
        "    (huggingface-cli download openai/gsm8k --repo-type dataset --local-dir ~/data/raw/gsm8k)\n"
        "  or the original jsonl release: grade_school_math/data/train.jsonl and test.jsonl "
        "(https://github.com/openai/grade-school-math)",
        raw_in_extra_info=("answer", "question"), other_configs=("socratic",)),
    "math": VerlSource(
        "DigitalLearningGmbH/MATH-lighteval", "~/data/math", "",
        "  the HF dataset DigitalLearningGmbH/MATH-lighteval: data/train-00000-of-00001.parquet and "
        "data/test-00000-of-00001.parquet\n"
        "    (huggingface-cli download DigitalLearningGmbH/MATH-lighteval --repo-type dataset "
        "--local-dir ~/data/raw/math)\n"
        "  or the original MATH release (MATH.tar, https://github.com/hendrycks/math): MATH/train/<subject>/*.json "
        "and MATH/test/<subject>/*.json"),
}


class UsageError(Exception):
    """A command line the script cannot run, or a dataset it cannot find (exit status 2)."""


def verl_row(dataset: str, record: dict, split: str, index: int) -> dict:
    """One row of verl's layout (the module's docstring), checked as megarl's own conversion checks it."""
    source, converted = VERL[dataset], DATASETS[dataset](record)
    kept = {k: v for k, v in converted.items() if k not in ("prompt", "answer")}  # MATH's level, type
    return kept | {"data_source": source.data_source,
                   "prompt": [{"role": "user", "content": converted["prompt"]}],
                   "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": converted["answer"]},
                   "extra_info": {"split": split, "index": index} | {k: record[k] for k in source.raw_in_extra_info}}


def file_split(relative: Path) -> str | None:
    """The split a dataset file belongs to by its name: train.jsonl, train-00000-of-00001.parquet (an HF shard) or
    any file under a train/ folder (MATH/train/algebra/1.json); likewise test. None for other files
    (train_socratic.jsonl, example_model_solutions.jsonl)."""
    for split in SPLITS:
        if relative.stem == split or relative.stem.startswith(f"{split}-") or split in relative.parts[:-1]:
            return split
    return None


def describe(files: list[Path], base: Path) -> str:
    names = [str(f.relative_to(base)) for f in files]
    return "none" if not names else names[0] if len(names) == 1 else f"{len(names)} files, {names[0]} ... {names[-1]}"


def find_splits(root: Path, source: VerlSource) -> tuple[dict[str, list[Path]], str]:
    """The train and test files under `root` (its config folder where it has one) and a line saying what was found;
    a UsageError naming what is missing and what to download when either split has none."""
    if not root.is_dir():
        raise UsageError(f"--local_dataset_path={root}: no such folder. Download one of:\n{source.download}")
    base = root / source.config_dir if source.config_dir and (root / source.config_dir).is_dir() else root
    files = sorted(p for p in base.rglob("*") if p.suffix in SUFFIXES and p.is_file()
                   and not any(part.startswith(".") or part in source.other_configs
                               for part in p.relative_to(base).parts))
    splits = {split: [f for f in files if file_split(f.relative_to(base)) == split] for split in SPLITS}
    found = "; ".join(f"{split}: {describe(splits[split], base)}" for split in SPLITS)
    missing = [split for split in SPLITS if not splits[split]]
    if missing:
        raise UsageError(f"--local_dataset_path={root}: no {' or '.join(missing)} split (files named {missing[0]}.*, "
                         f"{missing[0]}-*.* or under a {missing[0]}/ folder); found {found} among "
                         f"{len(files)} {'/'.join(SUFFIXES)} files. Download one of:\n{source.download}")
    return splits, f"found in {base}: {found}"


def write_verl_layout(dataset: str, args) -> int:
    """verl's mode: --local_dataset_path's splits -> train.parquet and test.parquet in --local_save_dir."""
    source = VERL[dataset]
    if args.hdfs_dir:
        raise UsageError(f"--hdfs_dir={args.hdfs_dir}: megarl writes local files only (--local_save_dir); copy "
                         "that folder to HDFS yourself")
    if args.local_dir and args.local_save_dir and args.local_dir != args.local_save_dir:
        raise UsageError(f"--local_dir={args.local_dir} and --local_save_dir={args.local_save_dir}: two output "
                         "folders (--local_dir is verl's older name of --local_save_dir): give one")
    if not args.local_dataset_path:
        raise UsageError(f"no --local_dataset_path: this script downloads nothing (no network); download "
                         f"{source.data_source} first, one of:\n"
                         f"{source.download}\nthen: python scripts/preprocess/{dataset}.py --local_dataset_path "
                         f"<that folder> --local_save_dir {source.save_dir}")
    out = Path(args.local_dir or args.local_save_dir or source.save_dir).expanduser()
    splits, found = find_splits(Path(args.local_dataset_path).expanduser(), source)
    print(found)
    converted = {}
    for split, files in splits.items():
        rows, skipped = convert_files(files, lambda record, index, split=split: verl_row(dataset, record, split, index),
                                      args.skip_malformed)
        if not rows:
            raise ValueError(f"no rows converted from the {split} split ({len(skipped)} malformed)")
        converted[split] = rows, skipped
    for split, (rows, skipped) in converted.items():
        write_records(out / f"{split}.parquet", rows)
        print(f"wrote {len(rows)} rows to {out / f'{split}.parquet'}; skipped {len(skipped)} malformed rows")
        for error in skipped[:5]:
            print(f"  skipped {error}")
    return 0


def write_megarl_layout(dataset: str, args) -> int:
    """megarl's mode: the positional inputs -> one prompt file, --output."""
    verl_flags = [f"--{key}" for key in ("local_dataset_path", "local_save_dir", "local_dir", "hdfs_dir")
                  if getattr(args, key)]
    if verl_flags:
        raise UsageError(f"{', '.join(verl_flags)} with positional inputs: give the inputs and --output (one megarl "
                         "prompt file), or --local_dataset_path and --local_save_dir (verl's train.parquet and "
                         "test.parquet)")
    if not args.inputs or not args.output:
        raise UsageError("positional inputs need --output (the prompt file to write), and --output needs inputs")
    rows, skipped = convert(args.inputs, DATASETS[dataset], args.skip_malformed)
    if not rows:
        raise ValueError(f"no rows converted from {', '.join(args.inputs)}")
    write_records(args.output, rows)
    print(f"wrote {len(rows)} rows to {args.output}; skipped {len(skipped)} malformed rows")
    for error in skipped[:5]:
        print(f"  skipped {error}")
    return 0


def main(dataset: str, argv: list[str] | None = None) -> int:
    source = VERL[dataset]
    parser = argparse.ArgumentParser(
        prog=f"scripts/preprocess/{dataset}.py",
        description=f"Convert {dataset} files into a megarl prompt file (positional inputs and --output), or into "
                    f"verl's train.parquet and test.parquet (--local_dataset_path, --local_save_dir).")
    parser.add_argument("inputs", nargs="*", help="input files (.jsonl, .parquet, .json) or folders of them")
    parser.add_argument("--output", help="the prompt file to write (.jsonl or .parquet)")
    parser.add_argument("--local_dataset_path", help=f"verl's layout: a downloaded copy of {source.data_source} "
                                                     "(its train and test splits are found by file name)")
    parser.add_argument("--local_save_dir", help=f"verl's layout: the folder train.parquet and test.parquet are "
                                                 f"written to (default {source.save_dir})")
    parser.add_argument("--local_dir", help="verl's older name of --local_save_dir")
    parser.add_argument("--hdfs_dir", help="verl's copy to HDFS: not supported (refused)")
    parser.add_argument("--skip-malformed", action="store_true", help="skip and count bad rows instead of stopping")
    args = parser.parse_args(argv)
    try:
        if args.inputs or args.output:
            return write_megarl_layout(dataset, args)
        return write_verl_layout(dataset, args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
