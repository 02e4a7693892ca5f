"""Prompt datasets: an endless shuffled iterator of prompt batches with resumable state, prompt
files, and supervised (SFT) batches in the shared token layout of megarl.protocol."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from megarl.protocol import Batch


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with no special tokens added (prompts and answers are spliced together)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PromptDataset:
    """Endless batches of prompts, reshuffled every epoch (the order depends only on seed and epoch).

    A batch may span two epochs, so every batch has exactly `batch_size` prompts. `state_dict()`
    captures where the iterator is; loading it into a dataset built from the same examples resumes
    with the same next batch.
    """

    def __init__(self, examples: list[dict], tokenizer, batch_size: int, seed: int = 0):
        if not examples:
            raise ValueError("PromptDataset needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.examples = [dict(ex, prompt_ids=encode(tokenizer, ex["prompt"])) for ex in examples]
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order()
            batch.append(dict(self.examples[self._order[self.position]]))
            self.position += 1
        return batch

    def __len__(self) -> int:
        return len(self.examples)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= state["position"] <= len(self.examples):
            raise ValueError(f"dataset state position {state['position']} is outside 0..{len(self.examples)}; "
                             f"was it saved for a different prompt set?")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._epoch_order()


def load_prompt_file(path: str | Path) -> list[dict]:
    """Examples from a .jsonl file, one object per line with string fields 'prompt' and 'answer'."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: prompt files must be .jsonl (one JSON object per line)")
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    examples = []
    with path.open() as f:
        for row, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, row {row}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}, row {row}: expected a JSON object, got {type(record).__name__}")
            for key in ("prompt", "answer"):
                if not isinstance(record.get(key), str):
                    raise ValueError(f"{path}, row {row}: field '{key}' must be a string, got {record.get(key)!r}")
            examples.append(record)
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def sft_batch(tokenizer, examples: list[dict]) -> Batch:
    """Teacher-forced batch: tokens = prompt + answer + eos, right-padded; trained on answer and eos.

    loss_mask[t] = 1 where tokens[t] is a target (predicted from tokens[<t]), as in megarl.protocol.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, targets = [], []
    for ex in examples:
        prompt_ids = ex.get("prompt_ids") or encode(tokenizer, ex["prompt"])
        target = encode(tokenizer, ex["answer"]) + [eos]
        rows.append(prompt_ids + target)
        targets.append((len(prompt_ids), len(prompt_ids) + len(target)))
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, (start, end)) in enumerate(zip(rows, targets)):
        tokens[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
        loss_mask[i, start:end] = 1.0
    return Batch({"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask},
                 {"prompt": [ex["prompt"] for ex in examples], "answer": [ex["answer"] for ex in examples]})
