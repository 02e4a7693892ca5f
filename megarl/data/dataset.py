"""Prompt datasets: an endless shuffled iterator of prompt batches with resumable state, prompt
files (.jsonl, .parquet), chat templates, and supervised (SFT) batches in the shared token layout of
megarl.protocol."""

from __future__ import annotations

import logging
import random
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.data.files import InputError, MalformedRow, iter_records
from megarl.protocol import IMAGE_INPUTS, Batch

logger = logging.getLogger(__name__)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with no special tokens added (prompts and answers are spliced together)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Example(dict):
    """A prompt record that remembers where it came from ("<file>, row N", "task 'add' train example N"), so
    that a problem found once the prompt is tokenized still names its row, and the directory its image paths are
    relative to (the prompt file's)."""

    def __init__(self, record: dict, origin: str, base_dir: str | Path = ".", **fields):
        super().__init__(record, **fields)
        self.origin = origin
        self.base_dir = base_dir


@dataclass
class PromptLimit:
    """The most tokens a prompt may have, where that number comes from (said in the error), and what becomes of a
    longer prompt (verl's options): an error (or, with data.skip_malformed, a skipped row), cut as `truncation` says
    (left, right, middle: see truncate), or with `filter` left out and counted."""
    tokens: int
    why: str
    truncation: str = "error"
    filter: bool = False

    def over(self, ids: list[int]) -> str:
        return f"prompt is {len(ids)} tokens, over the limit of {self.tokens} ({self.why})"


def truncate(ids: list[int], tokens: int, side: str) -> list[int]:
    """`tokens` of a longer prompt's ids, as verl's data.truncation keeps them: left keeps the last tokens (the end
    of the prompt, where a chat template's assistant turn starts), right the first, middle the first tokens // 2
    and the last tokens - tokens // 2."""
    if side == "left":
        return ids[len(ids) - tokens:]
    if side == "right":
        return ids[:tokens]
    if side == "middle":
        head = tokens // 2
        return ids[:head] + ids[len(ids) - (tokens - head):]
    raise ValueError(f"data.truncation={side!r}: a prompt can be cut left, right or middle")


class EpochOrder:
    """Endless draws of indices into `size` items, reshuffled every epoch (the order depends only on seed and
    epoch). A draw may span two epochs, so it always has the number of indices asked for. `state_dict()`
    captures where the order is; loading it into an order over the same items resumes with the same next draw."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed = size, seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(self.size))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next_indices(self, size: int) -> list[int]:
        indices = []
        while len(indices) < size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order()
            indices.append(self._order[self.position])
            self.position += 1
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if not 0 <= state["position"] <= self.size:
            raise ValueError(f"dataset state position {state['position']} is outside 0..{self.size}; "
                             f"was it saved for a different prompt set?")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._epoch_order()


class PromptDataset(EpochOrder):
    """Endless batches of prompts, reshuffled every epoch (EpochOrder: every batch has exactly `batch_size`
    prompts, and `state_dict()` resumes it).

    Each prompt is rendered and tokenized here, once; one that has no tokens, holds characters the
    tokenizer cannot encode, or is longer than `max_prompt_tokens` raises an InputError naming its row,
    or with `skip_malformed` is left out and counted (`skipped`: the problem by index in `examples`; logged).
    A prompt longer than the limit is instead cut (its 'prompt' text becomes its cut ids' decoding) where the limit's
    truncation says so, or left out where its filter is on (`overlong`: by index, as `skipped`; logged in one line).
    A row with `images` (megarl/data/images.py) gets `pixel_values` and `image_grid_thw` from `image_prompts` (the
    vision-language model's image processor) and its image placeholders expanded in `prompt_ids`; a missing or
    unreadable image is a problem of its row, as above.
    """

    def __init__(self, examples: list[dict], tokenizer, batch_size: int, seed: int = 0, chat_template: bool = False,
                 system_prompt: str = "", max_prompt_tokens: PromptLimit | None = None, skip_malformed: bool = False,
                 image_prompts=None):
        if not examples:
            raise ValueError("PromptDataset needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.examples, self.skipped, self.overlong = [], {}, {}
        limit, cut = max_prompt_tokens, 0
        for i, ex in enumerate(examples):
            where = getattr(ex, "origin", f"example {i}")
            try:
                # 'prompt' becomes the text the model sees (chat template applied), so rewards and logs see it too
                encoded = encode_prompt(ex, tokenizer, chat_template, system_prompt, image_prompts, where)
                problem = token_problem(tokenizer, encoded["prompt"], encoded["prompt_ids"])
            except InputError as e:  # an image that does not load names its row already
                encoded, problem = None, str(e).removeprefix(f"{where}: ")
            if problem is None and limit is not None and len(encoded["prompt_ids"]) > limit.tokens:
                if limit.filter:
                    self.overlong[i] = f"{where}: {limit.over(encoded['prompt_ids'])}"
                    continue
                if limit.truncation == "error" or encoded.get(IMAGE_INPUTS[0]) is not None:
                    # cutting a prompt with images would cut its image placeholders apart from its images
                    problem = limit.over(encoded["prompt_ids"]) + (
                        "; data.truncation cuts no prompt with images" if limit.truncation != "error" else "")
                else:
                    ids = truncate(encoded["prompt_ids"], limit.tokens, limit.truncation)
                    encoded = dict(encoded, prompt_ids=ids, prompt=tokenizer.decode(ids, skip_special_tokens=False))
                    cut += 1
            if problem is None:
                self.examples.append(encoded)
                continue
            problem = f"{where}: {problem}"
            if not skip_malformed:
                raise InputError(problem)
            self.skipped[i] = problem
        first = next(iter(self.skipped.values()), "")
        if self.skipped:
            logger.warning("skipped %d of %d prompts (data.skip_malformed); the first: %s", len(self.skipped),
                           len(examples), first)
        if self.overlong:
            first = next(iter(self.overlong.values()))
            logger.warning("left out %d of %d prompts over %d tokens (%s; data.filter_overlong_prompts); the first: %s",
                           len(self.overlong), len(examples), limit.tokens, limit.why, first)
        if cut:
            logger.warning("cut %d of %d prompts to %d tokens (%s; data.truncation=%s)", cut, len(examples),
                           limit.tokens, limit.why, limit.truncation)
        if not self.examples:
            raise InputError(f"no usable prompts: all {len(examples)} were skipped or left out; the first: {first}")
        self.batch_size = batch_size
        super().__init__(len(self.examples), seed)

    def next_batch(self, size: int | None = None) -> list[dict]:
        """The next `size` prompts (default: batch_size)."""
        return [dict(self.examples[i]) for i in self.next_indices(size or self.batch_size)]

    def __len__(self) -> int:
        return len(self.examples)


def encode_prompt(example: dict, tokenizer, chat_template: bool, system_prompt: str, image_prompts,
                  where: str) -> dict:
    """The example with 'prompt' rendered and 'prompt_ids'; a row with images also 'pixel_values' and
    'image_grid_thw' (megarl.data.images.image_examples, which every row of a vision-language run goes through: a
    row whose `<image>` markers outnumber its images, e.g. one whose image is missing, is named there)."""
    if not example.get("images") and image_prompts is None:
        text = render_prompt(tokenizer, example["prompt"], chat_template, system_prompt)
        return dict(example, prompt=text, prompt_ids=encode(tokenizer, text))
    if image_prompts is None:
        raise InputError(f"{where}: the row has images but the model takes none (no image processor: a "
                         "vision-language model directory has a preprocessor_config.json)")
    from megarl.data.images import image_examples

    named = example if hasattr(example, "origin") else Example(example, where)  # its errors name `where`
    return image_examples([named], tokenizer, image_prompts, getattr(example, "base_dir", "."), chat_template,
                          system_prompt)[0]


def token_problem(tokenizer, text: str, ids: list[int]) -> str | None:
    """What is wrong with a rendered prompt and its token ids (its length aside), or None."""
    if not ids:
        return f"prompt {text[:60]!r} has no tokens"
    lost = unencodable_characters(tokenizer, text, ids)
    if lost:
        return (f"characters the tokenizer cannot encode (dropped, or mapped to its unknown token): {lost!r} "
                f"in prompt {text[:60]!r}")
    return None


def unencodable_characters(tokenizer, text: str, ids: list[int]) -> str:
    """The characters of `text` that do not come back when `ids` are decoded, in order of first use. A space
    may be dropped or merged legitimately (SentencePiece's leading space), and a character may come back in
    its NFKC form (tokenizers that normalize), so neither counts as lost."""
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if decoded == text:
        return ""
    return "".join(c for c in dict.fromkeys(text)
                   if c != " " and c not in decoded and unicodedata.normalize("NFKC", c) not in decoded)


def prompt_problem(record: dict, key: str = "prompt") -> str | None:
    """What is wrong with a prompt record, or None. A record has its prompt in field `key` (a string, or a list of
    chat messages {'role', 'content'}) and 'answer' (a string or number; verl's layout, with the answer in
    'reward_model': {'ground_truth': ...}, is read too, where it may also be a list or dict: a search task's
    {'target': [...]}, a code task's tests)."""
    prompt = record.get(key)
    if key not in record:  # data.prompt_key names a field the file does not have
        return f"no field {key!r} (data.prompt_key); the row's fields: {', '.join(map(str, record))}"
    if isinstance(prompt, list):
        if not prompt:
            return f"field {key!r} is an empty list of chat messages"
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                   and isinstance(m.get("content"), str) for m in prompt):
            return f"field {key!r} is a list but not of chat messages {{'role': str, 'content': str}}"
        if not any(m["content"].strip() for m in prompt if m["role"] != "system"):
            return f"field {key!r} is empty: no chat message but a system one has any content"
    elif not isinstance(prompt, str):
        return f"field {key!r} must be a string or a list of chat messages, got {prompt!r}"
    elif not prompt.strip():
        return f"field {key!r} is empty ({prompt!r})"
    answer = record_answer(record)
    structured = record.get("answer") is None and isinstance(answer, (list, dict))  # verl's ground_truth
    if not isinstance(answer, str) and not structured:
        return f"field 'answer' must be a string, got {answer!r}"
    return None


def record_answer(record: dict):
    answer = record.get("answer")
    if answer is None and isinstance(record.get("reward_model"), dict):
        answer = record["reward_model"].get("ground_truth")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    return answer


def load_prompt_file(path: str | Path, skip_malformed: bool = False, skipped: list[str] | None = None,
                     prompt_key: str = "prompt") -> list[dict]:
    """Examples {'prompt', 'answer', ...} from a .jsonl or .parquet prompt file whose rows hold the prompt in field
    `prompt_key` (data.prompt_key; see prompt_problem).

    A malformed row (not valid UTF-8 or JSON, an empty prompt, no answer) raises an InputError naming the
    file and row; with skip_malformed it is skipped, the number skipped is logged, and each skipped row's
    problem is added to `skipped` when given. Each example is an Example that keeps its file and row, for the
    checks PromptDataset makes once it is tokenized."""
    examples, problems = [], []
    for row, record in iter_records(path):
        problem = str(record) if isinstance(record, MalformedRow) else None
        if problem is None and (reason := prompt_problem(record, prompt_key)):
            problem = str(MalformedRow(path, row, reason))
        if problem is None:
            examples.append(Example(record, f"{path}, row {row}", Path(path).parent, prompt=record[prompt_key],
                                    answer=record_answer(record)))
        elif skip_malformed:
            problems.append(problem)
        else:
            raise InputError(problem)
    if problems:
        logger.warning("%s: skipped %d malformed rows (data.skip_malformed); the first: %s", path, len(problems),
                       problems[0])
        if skipped is not None:
            skipped.extend(problems)
    if not examples:
        raise InputError(f"{path}: no examples" + (f" ({len(problems)} malformed rows skipped)" if problems else ""))
    return examples


def render_prompt(tokenizer, prompt: str | list[dict], chat_template: bool, system_prompt: str = "") -> str:
    """The prompt text the model sees: a plain string as it is, or, with chat_template (always for a list of
    messages), the tokenizer's chat template applied up to the assistant's turn."""
    if isinstance(prompt, str) and not chat_template:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"prompt {str(prompt)[:60]!r} needs a chat template (data.chat_template or a list of "
                         f"messages) but tokenizer {tokenizer.name_or_path!r} has none")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def sft_batch(tokenizer, examples: list[dict], renderer=None) -> Batch:
    """Teacher-forced batch: tokens = prompt + answer + eos, right-padded; trained on answer and eos.

    An example with `messages` (a multi-turn trace: assistant turns and tool results) is laid out as
    the agent loop lays out a rollout (megarl/rollout/agent.py): each assistant turn + eos, trained on,
    then the turn's tool results as `renderer` renders them, never trained on.
    loss_mask[t] = 1 where tokens[t] is a target (predicted from tokens[<t]), as in megarl.protocol.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, masks = [], []
    for ex in examples:
        prompt_ids = ex.get("prompt_ids") or encode(tokenizer, ex["prompt"])
        if "messages" in ex:
            target, mask = trace_tokens(tokenizer, ex["messages"], renderer)
        else:
            target = encode(tokenizer, ex["answer"]) + [eos]
            mask = [1.0] * len(target)
        rows.append(prompt_ids + target)
        masks.append([0.0] * len(prompt_ids) + mask)
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        tokens[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
        loss_mask[i, :len(row)] = torch.tensor(mask)
    # a vision-language policy's prompts with images: each row's own (None for text only), which MegatronEngine reads
    images = {k: [ex.get(k) for ex in examples] for k in IMAGE_INPUTS} \
        if any(ex.get(IMAGE_INPUTS[0]) is not None for ex in examples) else {}
    return Batch({"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask},
                 {"prompt": [ex["prompt"] for ex in examples], "answer": [ex["answer"] for ex in examples]} | images)


def trace_tokens(tokenizer, messages: list[dict], renderer) -> tuple[list[int], list[float]]:
    """Response tokens and loss mask of a multi-turn trace [{role: assistant | tool, content}]: consecutive
    tool messages are the results of the assistant turn before them, rendered together."""
    if renderer is None:
        raise ValueError("a multi-turn trace needs an observation renderer (megarl.rollout.agent.observation_renderer)")
    eos = tokenizer.eos_token_id
    ids, mask, results = [], [], []

    def flush():
        if results:
            observation = renderer.render(results, tokenizer.decode([eos]))
            ids.extend(observation)
            mask.extend([0.0] * len(observation))
            results.clear()

    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            results.append(str(m["content"]))
        elif m.get("role") == "assistant":
            flush()
            turn = encode(tokenizer, m["content"]) + [eos]
            ids.extend(turn)
            mask.extend([1.0] * len(turn))
        else:
            raise ValueError(f"trace message {i} has role {m.get('role')!r}; expected assistant or tool")
    flush()
    return ids, mask
