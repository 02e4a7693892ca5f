"""A run's inputs, checked before anything heavy starts: the model directory (config.json, tokenizer) and every
prompt, rendered and tokenized. RLTrainer builds its prompt datasets here; `python -m megarl.train --dry-run`
makes the same checks without loading weights or starting a worker. Each problem is an InputError naming
the file (and row) or the config key."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config.model_layout import check_model_layout, check_rollout_model
from megarl.data.dataset import PromptDataset, PromptLimit, load_prompt_file
from megarl.data.files import InputError
from megarl.data.tasks import load_examples
from megarl.utils.hf_config import TEXT_ONLY_TOWERS


def read_model_config(path: str | Path, key: str = "model.path") -> dict:
    """The HF config.json of the model directory `path` (set by config key `key`), read and parsed."""
    file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise InputError(f"{key}={path}: no such model directory")
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise InputError(f"{key}={path}: no config.json there") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{file}: not a readable JSON model config ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def prompt_limit(cfg, model_config: dict, where: str) -> PromptLimit | None:
    """The longest prompt (with what becomes of a longer one: data.truncation, data.filter_overlong_prompts):
    data.max_prompt_length where set, else the most that leaves room for a full response in the model's positions,
    max_position_embeddings minus the response budget (rollout.max_new_tokens; agent.max_response_tokens for
    multi-turn rollouts). A longer prompt's samples would run past the positions the model was trained on
    (or be cut by the engine), so a data.max_prompt_length beyond that room is refused too. None when neither
    data.max_prompt_length nor the config gives a length."""
    d = cfg.data
    options = {"truncation": d.truncation, "filter": d.filter_overlong_prompts}
    positions = model_config.get("max_position_embeddings")
    room = None
    if isinstance(positions, int):
        key, budget = (("agent.max_response_tokens", cfg.agent.max_response_tokens) if cfg.agent.enabled
                       else ("rollout.max_new_tokens", cfg.rollout.max_new_tokens))
        if budget >= positions:
            raise InputError(f"{key}={budget} leaves no room for a prompt: the model ({where}) has "
                             f"max_position_embeddings={positions}")
        room = positions - budget
        if d.max_prompt_length > room:
            raise InputError(f"data.max_prompt_length={d.max_prompt_length} with {key}={budget} runs past the "
                             f"model's max_position_embeddings={positions} ({where}): at most {room}; lower "
                             f"data.max_prompt_length or {key}")
    if d.max_prompt_length:
        return PromptLimit(d.max_prompt_length, f"data.max_prompt_length={d.max_prompt_length}", **options)
    if room is None:
        return None
    return PromptLimit(room, f"max_position_embeddings {positions} of {where} - {key} {budget}", **options)


@dataclass
class PromptSets:
    """The prompts of a run: RL training, the supervised warm start, and the held-out batch; `skipped` says
    what data.skip_malformed left out of them (file, row and problem), rows and tokenized prompts alike, and
    `overlong` what data.filter_overlong_prompts left out (file, row and length) of `limit`."""
    train: PromptDataset
    sft: PromptDataset
    val: list[dict]
    skipped: list[str]
    overlong: list[str] = field(default_factory=list)
    limit: PromptLimit | None = None

    def left_out(self) -> str:
        """What data.filter_overlong_prompts left out, as the start-up line says it; empty when nothing."""
        if not self.overlong:
            return ""
        return (f"{len(self.overlong)} prompts over {self.limit.tokens} tokens ({self.limit.why}) left out "
                f"(data.filter_overlong_prompts)")


def prompt_datasets(cfg, tokenizer, limit: PromptLimit | None) -> PromptSets:
    """Every prompt of the run loaded, rendered, tokenized and checked (see PromptDataset)."""
    if cfg.data.chat_template and not getattr(tokenizer, "chat_template", None):
        raise InputError(f"data.chat_template=true (the default) renders every prompt with the tokenizer's chat "
                         f"template, and the tokenizer of model.path={cfg.model.path} has none: set "
                         "data.chat_template=false to feed the prompts as they are")
    skipped: list[str] = []
    train, val = load_examples(cfg.data, cfg.trainer.seed, skipped)
    options = {"chat_template": cfg.data.chat_template, "system_prompt": cfg.data.system_prompt,
               "max_prompt_tokens": limit, "skip_malformed": cfg.data.skip_malformed,
               "image_prompts": image_prompts(cfg, tokenizer, train + val)}
    seed = cfg.trainer.seed
    train_set = PromptDataset(train, tokenizer, cfg.data.prompts_per_step, seed, **options)
    val_set = PromptDataset(val[:cfg.data.val_size or None], tokenizer, 1, 0, **options)  # taken whole, below
    skipped += [*train_set.skipped.values(), *val_set.skipped.values()]
    overlong = [*train_set.overlong.values(), *val_set.overlong.values()]
    if cfg.sft.data:  # multi-turn traces
        traces = load_prompt_file(cfg.sft.data, cfg.data.skip_malformed, skipped)
        sft_set = PromptDataset(traces, tokenizer, cfg.sft.batch_size, seed + 1, **options)
        skipped += sft_set.skipped.values()
        overlong += sft_set.overlong.values()
    else:  # the training prompts' reference answers, those that passed above
        sft_examples = [ex for i, ex in enumerate(train) if i not in train_set.skipped and i not in train_set.overlong]
        sft_set = PromptDataset(sft_examples, tokenizer, cfg.sft.batch_size, seed + 1, **options)
    return PromptSets(train_set, sft_set, val_set.next_batch(len(val_set)), skipped, overlong, limit)


def image_prompts(cfg, tokenizer, examples: list[dict]):
    """The model's image processor where a prompt row has images (megarl.data.images.ImagePrompts), else None."""
    if not any(ex.get("images") for ex in examples):
        return None
    model_type = (read_model_config(cfg.model.path) if Path(cfg.model.path).is_dir() else {}).get("model_type")
    if model_type in TEXT_ONLY_TOWERS:
        raise InputError(f"data.task={cfg.data.task} has prompt rows with images, but model.path={cfg.model.path} "
                         f"(model_type {model_type}) trains as a text-only policy: images are not used in training "
                         "(megarl/models/text_only.py lists the families, each of which says why); give it prompts without images")
    from megarl.data.images import ImagePrompts

    try:
        return ImagePrompts(cfg.model.path, tokenizer, cfg.data.min_pixels, cfg.data.max_pixels)
    except InputError as e:
        raise InputError(f"data.task={cfg.data.task} has prompt rows with images, but model.path={cfg.model.path} "
                         f"takes none: {e}") from None


def model_inputs(cfg) -> tuple[object, dict, str]:
    """model.path's tokenizer and config.json, and where that config is (the built-in tiny model's without writing
    it: it is built offline on first use)."""
    if cfg.model.path == "tiny":
        from megarl.models.tiny import build_char_tokenizer, tiny_config

        tokenizer = build_char_tokenizer()
        return (tokenizer, tiny_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).to_dict(),
                "the built-in tiny model")
    model_config = read_model_config(cfg.model.path)  # first: it names a missing directory
    return load_tokenizer(cfg.model.path), model_config, str(Path(cfg.model.path) / "config.json")


def check_inputs(cfg) -> tuple[str, dict, int]:
    """The dry run's checks: every model directory's config.json, the policy's tokenizer, and every prompt
    (as RLTrainer will load them). Returns a summary (a line, then the first skipped prompts), the policy's
    config.json and the longest prompt in tokens; raises InputError naming the problem."""
    tokenizer, model_config, where = model_inputs(cfg)
    check_model_layout(cfg.actor, "actor", model_config, where)
    check_rollout_model(cfg, model_config, where)  # SGLang cannot start from a quantized checkpoint
    critic = cfg.critic.path if cfg.algorithm.advantage == "gae" else ""  # only GAE uses a critic
    for role, path in (("critic", critic), ("reward_model", cfg.reward_model.path)):
        if path:
            check_model_layout(getattr(cfg, role), role, read_model_config(path, f"{role}.path"),
                               str(Path(path) / "config.json"))
    prompts = prompt_datasets(cfg, tokenizer, prompt_limit(cfg, model_config, where))
    skipped = f", {len(prompts.skipped)} skipped (data.skip_malformed)" if prompts.skipped else ""
    skipped += f", {prompts.left_out()}" if prompts.overlong else ""
    longest = max(len(ex["prompt_ids"]) for ex in [*prompts.train.examples, *prompts.val])
    summary = "\n  skipped ".join([f"prompts ok: {len(prompts.train)} training, {len(prompts.val)} held-out{skipped}"
                                   f", the longest {longest} tokens", *prompts.skipped[:5]])
    if cfg.model.path != "tiny" and (eos := eos_disagreement(cfg.model.path, tokenizer, cfg.rollout.engine)):
        summary += f"\nwarning: {eos}"
    return summary, model_config, longest


def load_tokenizer(path: str):
    """The model directory's tokenizer, its end-of-sequence token also its padding where it has none (Llama 3 and
    others; as verl does), so that every process that loads it pads with the same id. Rows are padded on the right
    behind an attention mask, so a padding id equal to EOS is never read as a token.
    Its eos token is the one generation stops at: where generation_config.json names eos ids that exclude the
    tokenizer's (transformers' GGUF import makes SmolLM2's bos <|im_start|> its eos), the first of them, so that the
    SFT targets, the agent loop's turn ends and the padding use the token the rollout engines end responses with."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError ... for a missing or broken one
        reason = " ".join(str(e).split())  # transformers' messages run over several lines
        raise InputError(f"model.path={path}: its tokenizer does not load ({type(e).__name__}: {reason})") from None
    stop_ids = generation_eos_ids(path)
    if stop_ids and tokenizer.eos_token_id not in stop_ids:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop_ids[0])
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise InputError(f"model.path={path}: its tokenizer has neither a pad token nor an eos token (set "
                             "eos_token in its tokenizer_config.json): rows cannot be padded, responses cannot end")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def generation_eos_ids(path: str | Path) -> list[int]:
    """The eos ids of the model directory's generation_config.json ([] where it has none)."""
    file = Path(path) / "generation_config.json"
    eos = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


def eos_disagreement(path: str, tokenizer, engine: str) -> str | None:
    """Where the tokenizer's own end-of-sequence token is not among generation_config.json's eos ids (transformers'
    GGUF import makes such a tokenizer): what responses stop at, and the eos token megarl writes and looks for
    (`tokenizer` as load_tokenizer gives it); None where they agree."""
    stops = generation_eos_ids(path)
    own = tokenizer.init_kwargs.get("eos_token")
    own_id = tokenizer.convert_tokens_to_ids(str(own)) if own is not None else None
    if not stops or own_id in stops:
        return None
    names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i in stops)
    sglang = " (and, under SGLang, at the tokenizer's own too)" if engine == "sglang" else ""
    line = (f"model.path={path}: its tokenizer's end-of-sequence token {str(own)!r} (id {own_id}) is not among "
            f"generation_config.json's eos_token_id: responses stop at {names}{sglang}; megarl's eos token (warm-start "
            f"targets, tool-turn ends, padding, reward_model.missing_eos_penalty) is {tokenizer.eos_token!r} (id "
            f"{tokenizer.eos_token_id})")
    if tokenizer.eos_token_id not in stops:
        line += (", which ends no response: make tokenizer_config.json's eos_token and generation_config.json's "
                 "eos_token_id agree")
    return line
