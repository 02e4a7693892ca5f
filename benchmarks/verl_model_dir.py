"""What verl 0.9.1 asks of a model directory on the way from a data row to a scored sample, and the
tokenizer both sides of benchmarks/e2e_vs_verl.py share: Qwen's chat tokens inside the vocabulary and a chat
template that renders a user message as its bare text (read in verl's sources: docs/benchmarks.md, 'Side by
side with verl')."""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# verl 0.9.1's agent loop picks its prompt builder by config.json's model_type: qwen2 -> QwenContinuousTokenBuilder,
# which requires '<|im_end|>' (and a one-token newline) of the tokenizer. Qwen's three chat tokens take ids 2..4 of
# the vocabulary (it does not grow); the plain template never renders them, so the prompts keep their tokens.
QWEN_CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def model_dir_problems(model_dir: Path, prompt: str, prompt_len: int, completion_len: int) -> list[str]:
    """What verl 0.9.1 requires of a model directory on the way from a data row to a scored sample, checked without
    verl: empty when every requirement holds, else one line per broken one (read in verl's sources: see
    docs/benchmarks.md, 'Side by side with verl')."""
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = []
    if len(config.get("architectures") or []) != 1:  # HFModelConfig asserts exactly one
        problems.append(f"config.json architectures={config.get('architectures')}: verl asserts exactly one")
    if len(tokenizer) != config["vocab_size"]:
        problems.append(f"tokenizer of {len(tokenizer)} tokens, model vocab_size {config['vocab_size']}")
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:  # padding of prompts/responses, hf config
        problems.append(f"pad_token_id={tokenizer.pad_token_id}, eos_token_id={tokenizer.eos_token_id}: both needed")
    if config.get("model_type") in ("qwen2", "qwen3"):  # QwenContinuousTokenBuilder's requirements
        for token in QWEN_CHAT_TOKENS:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or tokenizer.encode(token, add_special_tokens=False) != [token_id]:
                problems.append(f"tokenizer does not define {token!r} as one token (verl's agent loop requires "
                                f"'<|im_end|>' for model_type {config['model_type']})")
        if len(tokenizer.encode("\n", add_special_tokens=False)) != 1:
            problems.append("'\\n' is not one token (QwenContinuousTokenBuilder requires it)")
    if not tokenizer.chat_template:
        problems.append("no chat template: verl's agent loop renders every prompt with apply_chat_template")
    else:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=True)["input_ids"]
        plain = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if rendered != plain or len(plain) != prompt_len:
            problems.append(f"the chat template renders a {prompt_len}-token prompt as {len(rendered)} tokens, not "
                            f"the {len(plain)} megarl sees (verl left-truncates past data.max_prompt_length)")
    if config.get("max_position_embeddings", 0) <= prompt_len + completion_len:  # verl's max_model_len: the +1
        problems.append(f"max_position_embeddings={config.get('max_position_embeddings')} <= prompt + completion "
                        f"({prompt_len + completion_len}): verl's SGLang server caps completions below it")
    return problems


def verl_prompt_check(model_dir: Path, prompt: str) -> list[int]:
    """The prompt ids verl's own code makes of a data row's prompt with this model directory: its tokenizer loader,
    the agent loop's prompt builder for config.json's model_type (its constructor checks the tokens it needs), the
    initial render and the append of a response. Runs in verl's stack (needs only verl.utils.tokenizer);
    raises where verl would."""
    from transformers import AutoConfig
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
    from verl.utils.tokenizer.tokenizer import hf_processor, hf_tokenizer

    tokenizer = hf_tokenizer(str(model_dir))  # as HFModelConfig loads them: the processor is None for a text model
    model_type = AutoConfig.from_pretrained(model_dir).model_type
    processor = hf_processor(str(model_dir))
    builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type, processor=processor)
    prompt_ids = builder.build_initial_tokens([{"role": "user", "content": prompt}])
    response = tokenizer(prompt, add_special_tokens=False)["input_ids"][:4]
    merged = builder.merge_assistant_tokens(prompt_ids, response)
    if merged.token_ids != prompt_ids + response:
        raise ValueError(f"verl's {type(builder).__name__} changed the prompt + response tokens")
    return prompt_ids
