"""Preference pairs for reward-model training (python -m megarl.train_rm): files in the common public layouts,
or pairs built offline from a built-in task, tokenized and checked row by row.

A row holds `chosen` and `rejected`, and optionally `prompt`. Each side becomes one text the model reads whole:

  strings, no prompt          the whole conversation as text, as it is (Anthropic HH: "\\n\\nHuman: ... Assistant: ...")
  prompt + strings            prompt + response, concatenated (prompt/chosen/rejected columns); with
                              preference.chat_template, or a prompt given as chat messages, a user turn and an
                              assistant turn rendered by the tokenizer's chat template
  lists of chat messages      the conversation rendered by the chat template: the list itself when it holds the
                              prompt's turns (UltraFeedback-binarized: [user, assistant]; its `prompt` string is
                              then a copy, not read), else `prompt` before it (TRL's conversational layout with
                              an explicit prompt: chosen = [assistant])

With preference.append_eos the tokenizer's EOS token ends each side (unless it ends so already), as a policy's
sampled responses end in RL, where the reward model reads its score at the last token.

A row that cannot be used (not JSON, a missing or empty field, messages that are not {role, content}, a side
longer than the limit, characters the tokenizer cannot encode, chosen equal to rejected) raises an InputError
naming the file, the row and the field; with preference.skip_malformed it is skipped and counted instead.
"""

from __future__ import annotations

import json
import logging
import os
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from megarl.data.dataset import EpochOrder, PromptLimit, encode, unencodable_characters
from megarl.data.files import InputError, MalformedRow, iter_records
from megarl.data.tasks import TASKS, make_task, split_of, task_examples
from megarl.protocol import Batch

logger = logging.getLogger(__name__)

SIDES = ("chosen", "rejected")


@dataclass
class PreferencePair:
    chosen: list[int]  # token ids of the preferred text
    rejected: list[int]
    origin: str  # "<file>, row N" or "task 'reverse' train example N", for messages
    split_key: str = ""  # what the held-out split hashes: the prompt, or the text the two sides share


class FieldProblem(ValueError):
    """What is wrong with one field of a row."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field '{field}' {problem}")


@dataclass
class PairOptions:
    chat_template: bool = False  # render string prompts and responses as chat turns
    append_eos: bool = True
    limit: PromptLimit | None = None  # the most tokens a side may have
    skip_malformed: bool = False


# ---- one row -> two texts ------------------------------------------------------------------------------------


def _messages(value: list, field: str) -> list[dict]:
    if not value:
        raise FieldProblem(field, "is an empty list of chat messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        raise FieldProblem(field, "is a list but not of chat messages {'role': str, 'content': str}")
    return value


def _prompt_messages(prompt, side: str) -> list[dict]:
    if prompt is None:
        raise FieldProblem("prompt", f"is missing, and '{side}' holds no prompt (only assistant turns)")
    if isinstance(prompt, list):
        return _messages(prompt, "prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise FieldProblem("prompt", f"must be a non-empty string or a list of chat messages, got {prompt!r:.80}")
    return [{"role": "user", "content": prompt}]


def _render(tokenizer, messages: list[dict], field: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"field '{field}' needs a chat template (chat messages, or preference.chat_template) but "
                         f"tokenizer {tokenizer.name_or_path!r} has none")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def side_text(record: dict, side: str, tokenizer, chat_template: bool) -> str:
    """The text of one side ('chosen' or 'rejected') of a row, by the layouts in the module docstring."""
    prompt, value = record.get("prompt"), record.get(side)
    if value is None:  # null in a parquet file whose other rows have the column
        raise FieldProblem(side, "is null" if side in record else
                           f"is missing (the row has {', '.join(sorted(map(str, record))) or 'no fields'})")
    if isinstance(value, list):
        messages = _messages(value, side)
        if all(m["role"] == "assistant" for m in messages):  # the responses alone: the prompt goes first
            messages = _prompt_messages(prompt, side) + messages
        if messages[-1]["role"] != "assistant":
            raise FieldProblem(side, f"ends with a '{messages[-1]['role']}' message: the last must be the "
                                     "assistant's response")
        return _render(tokenizer, messages, side)
    if not isinstance(value, str):
        raise FieldProblem(side, f"must be a string or a list of chat messages, got {type(value).__name__}")
    if not value.strip():
        raise FieldProblem(side, f"is empty ({value!r})")
    if prompt is None:  # the whole conversation as text
        return value
    if isinstance(prompt, str) and not chat_template:
        return prompt + value
    return _render(tokenizer, _prompt_messages(prompt, side) + [{"role": "assistant", "content": value}], side)


def split_key(record: dict, chosen_text: str, rejected_text: str) -> str:
    """The prompt (chat messages as JSON), or without one the text both sides begin with (HH's conversation up to
    the last assistant turn): pairs of one prompt fall in the same split."""
    prompt = record.get("prompt")
    if prompt is not None:
        return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return os.path.commonprefix([chosen_text, rejected_text])


def side_ids(tokenizer, text: str, side: str, options: PairOptions) -> list[int]:
    ids = encode(tokenizer, text)
    if not ids:
        raise FieldProblem(side, f"has no tokens ({text[:60]!r})")
    lost = unencodable_characters(tokenizer, text, ids)
    if lost:
        raise FieldProblem(side, f"has characters the tokenizer cannot encode: {lost!r}")
    if options.append_eos and ids[-1] != tokenizer.eos_token_id:
        ids = ids + [tokenizer.eos_token_id]
    if options.limit is not None and len(ids) > options.limit.tokens:
        raise FieldProblem(side, f"is {len(ids)} tokens, over the limit of {options.limit.tokens} "
                                 f"({options.limit.why})")
    return ids


def record_pair(record: dict, origin: str, tokenizer, options: PairOptions) -> PreferencePair:
    """A row as a tokenized pair; FieldProblem (or InputError for a tokenizer without a needed chat template)."""
    texts = [side_text(record, side, tokenizer, options.chat_template) for side in SIDES]
    chosen, rejected = (side_ids(tokenizer, text, side, options) for text, side in zip(texts, SIDES))
    if chosen == rejected:
        raise FieldProblem("chosen", "equals field 'rejected': the pair prefers nothing")
    return PreferencePair(chosen, rejected, origin, split_key(record, *texts))


# ---- files and built-in tasks ----------------------------------------------------------------------------------


def load_preference_file(path: str | Path, tokenizer, options: PairOptions,
                         skipped: list[str] | None = None) -> list[PreferencePair]:
    """Every usable row of a .jsonl/.parquet/.json preference file (tokenized_pairs)."""
    return tokenized_pairs(((f"{path}, row {row}", record) for row, record in iter_records(path)), str(path),
                           tokenizer, options, skipped)


def tokenized_pairs(records: Iterable[tuple[str, dict | MalformedRow]], where: str, tokenizer, options: PairOptions,
                    skipped: list[str] | None = None) -> list[PreferencePair]:
    """(origin, row) -> pairs. A malformed row raises an InputError naming its origin (file and row) and field, or
    with options.skip_malformed is skipped: logged, and added to `skipped`."""
    pairs, problems = [], []
    for origin, record in records:
        if isinstance(record, MalformedRow):
            problem = str(record)
        else:
            try:
                pairs.append(record_pair(record, origin, tokenizer, options))
                continue
            except FieldProblem as e:
                problem = f"{origin}: {e}"
        if not options.skip_malformed:
            raise InputError(problem)
        problems.append(problem)
    if problems:
        logger.warning("%s: skipped %d malformed preference rows (preference.skip_malformed); the first: %s", where,
                       len(problems), problems[0])
        if skipped is not None:
            skipped.extend(problems)
    if not pairs:
        raise InputError(f"{where}: no usable preference pairs" + (f" ({len(problems)} malformed rows skipped; the "
                                                                   f"first: {problems[0]})" if problems else ""))
    return pairs


def corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer of the kinds a policy gives: near misses (one character replaced by one of the answer's kind:
    digits for numbers, letters otherwise; two neighbours swapped; one dropped; one added) and, a third of the time,
    one that runs on (two or three characters more) or is written backwards."""
    alphabet = string.digits if answer.isdigit() else string.ascii_lowercase
    while True:
        chars, kind = list(answer), rng.randrange(6)
        if kind == 0:
            i = rng.randrange(len(chars))
            chars[i] = rng.choice([c for c in alphabet if c != chars[i]])
        elif kind == 1 and len(chars) > 1:
            i = rng.randrange(len(chars) - 1)
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
        elif kind == 2 and len(chars) > 1:
            del chars[rng.randrange(len(chars))]
        elif kind == 3:
            chars.insert(rng.randrange(len(chars) + 1), rng.choice(alphabet))
        elif kind == 4:
            chars += [rng.choice(alphabet) for _ in range(rng.randint(2, 3))]
        else:
            chars.reverse()
        wrong = "".join(chars)
        if wrong != answer:
            return wrong


def task_preferences(name: str, n: int, seed: int, split: str, min_len: int, max_len: int) -> list[dict]:
    """Rows {prompt, chosen, rejected} of a built-in task (megarl/data/tasks.py): chosen its answer, rejected
    a corrupted answer (corrupt), the same rows for the same arguments. Each keeps its example's origin."""
    task = make_task(name, min_len=min_len, max_len=max_len)
    examples = task_examples(task, n, seed, split)
    rng = random.Random(f"preferences:{name}:{seed}:{split}")
    for example in examples:
        example.update(chosen=example["answer"], rejected=corrupt(example["answer"], rng))
    return examples


# ---- the run's pairs -------------------------------------------------------------------------------------------


class PairDataset(EpochOrder):
    """Endless batches of preference pairs, reshuffled every epoch; resumable (EpochOrder)."""

    def __init__(self, pairs: list[PreferencePair], batch_size: int, seed: int = 0):
        if not pairs:
            raise ValueError("PairDataset needs at least one pair")
        self.pairs, self.batch_size = pairs, batch_size
        super().__init__(len(pairs), seed)

    def next_batch(self) -> list[PreferencePair]:
        return [self.pairs[i] for i in self.next_indices(self.batch_size)]

    def __len__(self) -> int:
        return len(self.pairs)


@dataclass
class PreferenceSets:
    train: PairDataset
    val: list[PreferencePair]
    skipped: list[str]  # the malformed rows preference.skip_malformed left out


def preference_sets(cfg, tokenizer, limit: PromptLimit | None) -> PreferenceSets:
    """The run's training pairs and held-out pairs (cfg: the whole Config; see PreferenceConfig)."""
    p = cfg.preference
    options = PairOptions(p.chat_template, p.append_eos, limit, p.skip_malformed)
    skipped: list[str] = []
    if p.train in TASKS:
        def task_pairs(split: str, n: int) -> list[PreferencePair]:
            rows = task_preferences(p.train, n, cfg.trainer.seed, split, cfg.data.min_len, cfg.data.max_len)
            return tokenized_pairs(((r.origin, r) for r in rows), f"task {p.train!r}", tokenizer, options, skipped)
        train = task_pairs("train", p.task_pairs)
        val = [] if p.val else task_pairs("val", p.val_size)
    else:
        train = load_preference_file(p.train, tokenizer, options, skipped)
        val = [] if p.val else [pair for pair in train if split_of(pair.split_key) == "val"]
        train = train if p.val else [pair for pair in train if split_of(pair.split_key) == "train"]
    if p.val:
        val = load_preference_file(p.val, tokenizer, options, skipped)
    if not train or not val:
        raise InputError(f"preference.train={p.train!r} gives {len(train)} training and {len(val)} held-out pairs; "
                         "both must be non-empty (set preference.val for a small file)")
    return PreferenceSets(PairDataset(train, p.pairs_per_step, cfg.trainer.seed), val[:p.val_size], skipped)


def pair_batch(pairs: list[PreferencePair], pad_id: int) -> Batch:
    """Rows 2k (chosen) and 2k+1 (rejected) of pair k, right-padded: the engine's bradley_terry layout."""
    rows = [ids for pair in pairs for ids in (pair.chosen, pair.rejected)]
    tokens = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(tokens)
    for i, ids in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    return Batch({"tokens": tokens, "attention_mask": attention_mask, "loss_mask": attention_mask.float()})
