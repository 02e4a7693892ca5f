"""DeepMind's mathematics_dataset (Saxton et al. 2019, PyPI mathematics_dataset 1.0.1) -> train.parquet and
test.parquet in verl's layout (megarl/data/preprocess.py), generated offline by the library itself, by module and
difficulty, the two splits disjoint (no question text in both).

  python scripts/preprocess/mathematics_dataset.py --out data/mathematics_dataset
  python scripts/preprocess/mathematics_dataset.py --out DIR --modules arithmetic__add_or_sub numbers__round_number \\
      --train-difficulty train-easy train-medium --test-difficulty interpolate --train 1000 --test 64 --seed 0

  then  data.task=DIR/train.parquet data.val_task=DIR/test.parquet   (configs/smollm2_math_grpo.yaml)

Difficulties, as the library's own generate.py names them: train-easy, train-medium, train-hard (the lower, middle
and upper third of a module's entropy range), interpolate (modules.test(): the whole range) and extrapolate
(modules.test_extra(): larger problems, under their own module names such as arithmetic__add_or_sub_big; give those
with --test-modules). --train is a count per training module and difficulty, --test per held-out module. The
held-out split is drawn first; a training draw whose question text is already taken (by either split) is drawn
again, so each question occurs once in all. A problem whose question or answer is longer than the library's limits
(160 and 30 characters) is dropped, as generate.py drops it.

Each row: data_source "deepmind/math_dataset" (its Hugging Face name; the reward routing scores it with the math
reward, math-verify: answers like "-13", "0.25", "2/7" or "-90.405" compared as numbers, a \\boxed{} answer first,
else the response's last expression), prompt [{"role": "user", "content": question + MATH_INSTRUCTION}], ability
"math", reward_model {"style": "rule", "ground_truth": answer}, extra_info {"split", "index", "module",
"difficulty", "question"}.

Why a virtual environment of its own. mathematics_dataset does not import with the sympy megarl's environment needs
(math-verify; sympy 1.14 here): `from sympy.solvers.diophantine import base_solution_linear` raises ImportError
(sympy 1.6 made diophantine a package). A shim that puts the function back imports, but measured here (5 problems
per training module from one seed, against the pinned venv): with megarl's numpy 2, 14 of the 56 training modules
fail (`np.object`, `ndarray.itemset`), and 7 more (numbers__is_prime, algebra__linear_1d, ...) write other problems
than the library does under the sympy it was written for. Under sympy 1.5.1 (the newest < 1.6) polynomials__add and
polynomials__compose still fail (numpy integers reach sympy's `as_content_primitive`); sympy 1.4 with numpy 1.23.5
runs all 56. So the library runs in a clean venv (no system site packages) with PINS, built once under
$MEGARL_CACHE (or ~/.cache/megarl) by pip from the configured index (--find-links DIR: from a folder of wheels
only); this same file runs there (`sample`) and writes raw rows, which megarl's writer turns into the prompt files
in megarl's environment. Building the venv took ~4.5 min here (2 busy cores, a local index); generating 6000
problems then takes seconds.

Reproducibility: each (split, module, difficulty) draws from Python's and numpy's generators seeded from --seed and
its own name (so adding a module leaves the others' problems as they were), with PYTHONHASHSEED=0. The default
modules give the same files every time; polynomials__add, polynomials__compose and most *_composed modules do not
(the library orders some of their statements by object identity).
"""

from __future__ import annotations  # the venv's interpreter (--python) may be older than megarl's

import os
import sys

# Python puts this folder first on the import path: `import mathematics_dataset` would load this script and the
# standard library's `import math` (random, tempfile) math.py beside it. Take the folder off before importing.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import argparse  # noqa: E402
import fcntl  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

PINS = ("mathematics_dataset==1.0.1", "sympy==1.4", "numpy==1.23.5", "mpmath==1.3.0", "absl-py==2.1.0",
        "six==1.16.0")
VENV_NAME = "mathematics_dataset-1.0.1-sympy1.4-numpy1.23.5"
DATA_SOURCE = "deepmind/math_dataset"
TRAIN_DIFFICULTIES = ("train-easy", "train-medium", "train-hard")
DIFFICULTIES = TRAIN_DIFFICULTIES + ("interpolate", "extrapolate")
DEFAULT_MODULES = ("arithmetic__add_or_sub", "arithmetic__mul", "arithmetic__div", "numbers__round_number")
MAX_DRAWS_PER_ROW = 50  # a module with fewer distinct questions than asked stops here, naming itself


# --- in the venv: the library draws the problems ---------------------------------------------------------------

def _flatten(modules, prefix=""):
    flat = {}
    for key, value in modules.items():
        name = f"{prefix}__{key}" if prefix else key
        flat.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return flat


def _entropy_range(level: int, levels: int):
    """The `level`-th of `levels` equal parts of a module's entropy range (generate.py's _make_entropy_fn)."""
    def part(range_):
        low, length = range_[0], range_[1] - range_[0]
        return low + level / levels * length, low + (level + 1) / levels * length
    return part


def _module_sets() -> dict:
    from mathematics_dataset.modules import modules

    sets = {name: _flatten(modules.train(_entropy_range(level, 3))) for level, name in enumerate(TRAIN_DIFFICULTIES)}
    return {**sets, "interpolate": _flatten(modules.test()), "extrapolate": _flatten(modules.test_extra())}


def part_seed(seed: int, split: str, difficulty: str, module: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{split}/{difficulty}/{module}".encode()).digest()[:4], "little")


def sample(request: dict) -> list[dict]:
    """The raw rows of request["parts"] ({"split", "difficulty", "module", "count"} each, drawn in that order), no
    question twice. Runs where mathematics_dataset imports (the venv)."""
    import random

    import numpy as np
    from mathematics_dataset import generate_settings

    module_sets, seen, rows = _module_sets(), set(), []
    for part in request["parts"]:
        split, difficulty, module, count = part["split"], part["difficulty"], part["module"], part["count"]
        if module not in module_sets[difficulty]:
            raise SystemExit(f"no module {module!r} at difficulty {difficulty}; its modules: "
                             f"{', '.join(sorted(module_sets[difficulty]))}")
        seed = part_seed(request["seed"], split, difficulty, module)
        random.seed(seed)
        np.random.seed(seed)
        taken = 0
        for _ in range(count * MAX_DRAWS_PER_ROW):
            if taken == count:
                break
            problem = module_sets[difficulty][module]()
            question, answer = str(problem.question), str(problem.answer)
            if (len(question) > generate_settings.MAX_QUESTION_LENGTH or
                    len(answer) > generate_settings.MAX_ANSWER_LENGTH or question in seen):
                continue
            seen.add(question)
            rows.append({"split": split, "module": module, "difficulty": difficulty, "question": question,
                         "answer": answer})
            taken += 1
        if taken < count:
            raise SystemExit(f"{module} at {difficulty} gave {taken} distinct new questions in "
                             f"{count * MAX_DRAWS_PER_ROW} draws, fewer than the {count} asked for the {split} split")
    return rows


# --- in megarl's environment: the venv, and the prompt files --------------------------------------------------

def build_venv(venv: Path, python: str, find_links: str | None) -> Path:
    """The venv's interpreter, the venv built first where it is not complete (a marker file says it is; a lock
    file makes a second process wait for the first)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    interpreter, complete = venv / "bin" / "python", venv / ".complete"
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete.exists():
            return interpreter
        shutil.rmtree(venv, ignore_errors=True)  # a build that stopped half-way
        print(f"building {venv} (once): {' '.join(PINS)}", flush=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        source = ["--no-index", "--find-links", find_links] if find_links else []
        pip = subprocess.run([str(interpreter), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              *source, *PINS], capture_output=True, text=True)
        if pip.returncode != 0:
            raise RuntimeError(f"pip could not install {' '.join(PINS)} into {venv} (exit {pip.returncode}; with no "
                               f"package index reachable, download them and pass --find-links): "
                               f"{pip.stderr.strip()[-1500:]}")
        complete.touch()
    return interpreter


def sample_in_venv(interpreter: Path, request: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        request_file, rows_file = Path(tmp) / "request.json", Path(tmp) / "rows.jsonl"
        request_file.write_text(json.dumps(request))
        # sympy's and the library's deprecation warnings are noise here; errors still reach stderr
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONHASHSEED": "0"}
        env.pop("PYTHONPATH", None)  # nothing of megarl's environment
        run = subprocess.run([str(interpreter), os.path.abspath(__file__), "sample", str(request_file),
                              str(rows_file)], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(run.stderr.strip()[-3000:] or f"sampling exited {run.returncode}")
        return [json.loads(line) for line in rows_file.read_text().splitlines()]


def prompt_row(raw: dict, index: int) -> dict:
    from megarl.data.preprocess import MATH_INSTRUCTION

    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{raw['question']} {MATH_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": raw["answer"]},
            "extra_info": {"split": raw["split"], "index": index, "module": raw["module"],
                           "difficulty": raw["difficulty"], "question": raw["question"]}}


def write_splits(raw_rows: list[dict], out: Path) -> dict[str, int]:
    """train.parquet and test.parquet in `out` from raw rows ({"split", "module", "difficulty", "question",
    "answer"}); a ValueError naming the row when a field is missing or a question is in both splits."""
    from megarl.data.files import write_records

    splits = {"train": [], "test": []}
    for number, raw in enumerate(raw_rows, start=1):
        missing = [k for k in ("split", "module", "difficulty", "question", "answer") if not raw.get(k)]
        if missing:
            raise ValueError(f"raw row {number}: no {', '.join(missing)}")
        if raw["split"] not in splits:
            raise ValueError(f"raw row {number}: split {raw['split']!r} is neither train nor test")
        splits[raw["split"]].append(raw)
    held_out = {raw["question"] for raw in splits["test"]}
    for number, raw in enumerate(splits["train"], start=1):
        if raw["question"] in held_out:
            raise ValueError(f"training row {number} ({raw['module']}, {raw['difficulty']}) is also held out: "
                             f"{raw['question']!r}")
    for split, rows in splits.items():
        if not rows:
            raise ValueError(f"no {split} rows")
        write_records(out / f"{split}.parquet", [prompt_row(raw, i) for i, raw in enumerate(rows)])
    return {split: len(rows) for split, rows in splits.items()}


def request_of(args) -> dict:
    test_modules = args.test_modules or args.modules
    parts = [{"split": "test", "difficulty": args.test_difficulty, "module": m, "count": args.test}
             for m in test_modules]
    parts += [{"split": "train", "difficulty": d, "module": m, "count": args.train}
              for m in args.modules for d in args.train_difficulty]
    return {"seed": args.seed, "parts": parts}


def main(argv=None) -> int:
    from megarl.utils.cache import cache_root

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES),
                        help="the training split's modules (and the held-out split's, without --test-modules)")
    parser.add_argument("--test-modules", nargs="+", help="the held-out split's modules (extrapolate: their names)")
    parser.add_argument("--train-difficulty", nargs="+", choices=TRAIN_DIFFICULTIES, default=["train-easy"])
    parser.add_argument("--test-difficulty", choices=DIFFICULTIES, default="train-easy")
    parser.add_argument("--train", type=int, default=1500, help="training problems per module and difficulty")
    parser.add_argument("--test", type=int, default=64, help="held-out problems per module")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--venv", type=Path, help=f"the library's venv (default <cache>/{VENV_NAME})")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the venv is built from "
                        "(numpy 1.23.5 has wheels up to Python 3.11)")
    parser.add_argument("--find-links", help="install the venv from this folder of wheels only (no index)")
    args = parser.parse_args(argv)
    if args.train < 1 or args.test < 1:
        parser.error(f"--train {args.train} and --test {args.test} must be at least 1")
    try:
        interpreter = build_venv(args.venv or cache_root() / VENV_NAME, args.python, args.find_links)
        counts = write_splits(sample_in_venv(interpreter, request_of(args)), args.out)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/train.parquet ({counts['train']}) and {args.out}/test.parquet ({counts['test']})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["sample"]:  # in the venv: request file in, raw rows out
        request_path, rows_path = sys.argv[2:4]
        rows = sample(json.loads(Path(request_path).read_text()))
        Path(rows_path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        sys.exit(main())
