"""Built-in synthetic tasks: short character-level problems a ~100k-parameter model can learn on a CPU.

  reverse   "abcd>"  -> "dcba"   letters from `alphabet`, operand length in [min_len, max_len]
  add       "12+345=" -> "357"   operands with min_len..max_len digits (keep max_len <= 3 so prompts
                                 stay within ~8 characters)
  mul       "37*58=" -> "2146"   the same operands, multiplied: beyond the tiny model unaided, the
                                 task of the calculator-tool recipe (configs/tool_calculator.yaml)

Each task makes `{"prompt", "answer"}` examples, deterministic per seed. The train and val splits are
disjoint by construction: an example belongs to the split chosen by a hash of its prompt, so no seed
or size can leak a validation prompt into training. The reward of each task has the task's name in
megarl.rewards.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from megarl.config.sections import BUILT_IN_VAL_SIZE
from megarl.data.dataset import Example, load_prompt_file

SPLITS = ("train", "val")
VAL_PERCENT = 10  # share of the example space held out for validation


def split_of(prompt: str) -> str:
    """'val' for a fixed ~10% of all prompts, 'train' for the rest (stable across runs and machines)."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little") % 100
    return "val" if bucket < VAL_PERCENT else "train"


@dataclass
class SyntheticTask:
    """Base: subclasses draw one random example; this class handles seeding, splits and dedup."""

    name = ""
    min_len: int = 3
    max_len: int = 5

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"task '{self.name}': need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")

    def draw(self, rng: random.Random) -> dict:
        raise NotImplementedError

    def num_prompts(self) -> int | None:
        """How many distinct prompts the task has, where that is small enough to matter (else None)."""
        return None

    def make_examples(self, n: int, seed: int, split: str = "train") -> list[dict]:
        """`n` distinct examples of `split`, the same list for the same (task, seed, split)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}': expected one of {SPLITS}")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        examples, seen = [], set()
        for _ in range(100 * n + 1000):
            if len(examples) == n:
                return examples
            ex = self.draw(rng)
            if ex["prompt"] not in seen and split_of(ex["prompt"]) == split:
                seen.add(ex["prompt"])
                examples.append(ex)
        raise ValueError(f"task '{self.name}' with lengths {self.min_len}..{self.max_len} has too few distinct "
                         f"'{split}' examples for n={n}; widen the lengths or ask for fewer")


@dataclass
class ReverseTask(SyntheticTask):
    name = "reverse"
    alphabet: str = "abcdefghijklmnopqrstuvwxyz"

    def draw(self, rng: random.Random) -> dict:
        word = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        return {"prompt": word + ">", "answer": word[::-1]}


@dataclass
class AddTask(SyntheticTask):
    name = "add"
    min_len: int = 1
    max_len: int = 3

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_len, self.max_len)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    def draw(self, rng: random.Random) -> dict:
        a, b = self._operand(rng), self._operand(rng)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    def num_prompts(self) -> int:
        return (10 ** self.max_len - (10 ** (self.min_len - 1) if self.min_len > 1 else 0)) ** 2


@dataclass
class MulTask(AddTask):
    name = "mul"

    def draw(self, rng: random.Random) -> dict:
        a, b = self._operand(rng), self._operand(rng)
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


TASKS: dict[str, type[SyntheticTask]] = {"reverse": ReverseTask, "add": AddTask, "mul": MulTask}


def make_task(name: str, **options) -> SyntheticTask:
    """A built-in task by name; `options` are its fields (min_len, max_len, alphabet for reverse)."""
    if name not in TASKS:
        raise KeyError(f"unknown task '{name}'; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name](**options)


TRAIN_POOL = 10_000  # examples drawn for the training split of a built-in task


def load_examples(data_cfg, seed: int, skipped: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(train, val) examples for a DataConfig: a built-in task, or a .jsonl/.parquet prompt file (the rows
    data.skip_malformed skips are added to `skipped` when given).

    A prompt file without `val_task` is split by the same prompt hash as the built-in tasks.
    """
    skip = data_cfg.skip_malformed
    if data_cfg.task in TASKS:
        task = make_task(data_cfg.task, min_len=data_cfg.min_len, max_len=data_cfg.max_len)
        # a small task (2-digit products: 8100 prompts) gives half its prompts, all found by random draws
        train = task_examples(task, min(TRAIN_POOL, (task.num_prompts() or 2 * TRAIN_POOL) // 2), seed, "train")
        val = [] if data_cfg.val_task else task_examples(task, data_cfg.val_size or BUILT_IN_VAL_SIZE, seed, "val")
    elif data_cfg.task.endswith((".jsonl", ".parquet")):
        rows = load_prompt_file(data_cfg.task, skip, skipped, data_cfg.prompt_key)
        train = rows if data_cfg.val_task else [r for r in rows if split_of(prompt_key(r)) == "train"]
        val = [] if data_cfg.val_task else [r for r in rows if split_of(prompt_key(r)) == "val"]
    else:
        raise ValueError(f"data.task={data_cfg.task!r}: expected a built-in task ({', '.join(TASKS)}) "
                         f"or a .jsonl/.parquet prompt file")
    if data_cfg.val_task:
        val = load_prompt_file(data_cfg.val_task, skip, skipped, data_cfg.prompt_key)
    if not train or not val:
        raise ValueError(f"data.task={data_cfg.task!r} gives {len(train)} training and {len(val)} validation "
                         f"examples; both must be non-empty (set data.val_task for a small prompt file)")
    return train, val


def task_examples(task: SyntheticTask, n: int, seed: int, split: str) -> list[Example]:
    """make_examples, each example named by task, split and index for errors found once it is tokenized."""
    return [Example(ex, f"task '{task.name}' {split} example {i}")
            for i, ex in enumerate(task.make_examples(n, seed, split))]


def prompt_key(example: dict) -> str:
    """The text a prompt is split by (a list of chat messages as its JSON)."""
    prompt = example["prompt"]
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
