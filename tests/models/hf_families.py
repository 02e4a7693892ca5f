"""Tiny random checkpoints of every supported family, written offline by transformers itself.

All: GQA (4 query heads, 2 KV heads), vocabulary 101 (not divisible by TP=2), 2 layers (one per
stage at PP=2), norms around 1 and other weights large enough that next-token distributions and
router choices are far from uniform.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.engine.hf_models import VOCAB

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
# Llama 3.1's RoPE scaling; with theta=5e5 and head_dim 8 the four frequencies fall in all three
# regimes of the llama3 rule (kept, smoothed, divided by the factor).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(**{**COMMON, "max_position_embeddings": 131072}, head_dim=8, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=tied,
                       architectures=["LlamaForCausalLM"])


def qwen3_config(tied: bool) -> Qwen3Config:
    # head_dim 16: the attention width (4 x 16) differs from hidden_size, as in the published Qwen3.
    return Qwen3Config(**COMMON, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=tied, architectures=["Qwen3ForCausalLM"])


def qwen3_moe_config(tied: bool, norm_topk_prob: bool, num_experts: int = 4) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=16,
                          norm_topk_prob=norm_topk_prob, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                          tie_word_embeddings=tied, architectures=["Qwen3MoeForCausalLM"])


MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
                 "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}


def save_random(config, path, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.architectures[0]](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)
