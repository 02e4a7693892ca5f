"""Tiny Qwen2 checkpoints written by transformers itself, and its reference log-probs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from megarl.protocol import Batch

VOCAB = 101  # prime: not divisible by TP=2, so megatron pads the vocabulary


def make_qwen2_dir(path, tied: bool, seed: int = 0, layers: int = 2) -> str:
    """GQA (4 query heads, 2 KV heads), random non-zero q/k/v biases and norm weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                         architectures=["Qwen2ForCausalLM"])
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Large enough weights that the next-token distributions are far from uniform.
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


def make_distinct_qwen2_dir(path, vocab_size: int, layers: int, heads: int, kv_heads: int) -> str:
    """Hidden 64, FFN 128, untied, every element random and distinct: a tensor or row moved to the wrong place
    cannot pass a bitwise comparison (the resharding tests)."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


def padded_batch(rows: int = 5, T: int = 12, seed: int = 1) -> Batch:
    """Right-padded rows of different lengths (one of full length, one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, T), generator=g)
    lengths = torch.tensor([T, 7, 1, 10, 4, 9, 12, 3][:rows])
    attention_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    tokens = tokens * attention_mask
    loss_mask = attention_mask.float()
    loss_mask[:, :2] = 0  # the "prompt"
    return Batch({"tokens": tokens, "attention_mask": attention_mask, "loss_mask": loss_mask})


@torch.no_grad()
def hf_logprobs_entropy(model_dir: str, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own model class for the checkpoint: aligned log p(tokens[t] | <t) and entropy, 0 at t=0 / padding."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, mask = batch["tokens"], batch["attention_mask"]
    logits = model(input_ids=tokens, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    real = mask[:, 1:] > 0
    pad = torch.nn.functional.pad
    return pad(torch.where(real, lp, 0.0), (1, 0)), pad(torch.where(real, ent, 0.0), (1, 0))
