"""Tiny random checkpoints of every supported family, written offline by transformers itself.

All: GQA (4 query heads, 2 KV heads), vocabulary 101 (not divisible by TP=2), 2 layers (one per
stage at PP=2), norms around 1 and other weights large enough that next-token distributions and
router choices are far from uniform.
"""

from __future__ import annotations

import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          GptOssForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration)

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


def mistral_config(**overrides) -> MistralConfig:
    """Mistral-Nemo style: head_dim 12 given explicitly, so the attention width (4 x 12) is not hidden_size; FFN 40.
    sliding_window = max_position_embeddings = 12, padded_batch's longest row: transformers takes its sliding-window
    path, whose window reaches the first token from the last one exactly (megarl accepts such a window and runs full
    attention, models/mistral.py)."""
    params = dict(COMMON, intermediate_size=40, head_dim=12, max_position_embeddings=12, sliding_window=12,
                  rope_parameters={"rope_type": "default", "rope_theta": 2e5}, tie_word_embeddings=False,
                  architectures=["MistralForCausalLM"])
    return MistralConfig(**(params | overrides))


def mixtral_config(**overrides) -> MixtralConfig:
    """Mixtral-8x7B style at a tiny size: 4 experts of intermediate_size 24, top 2, no sliding window."""
    params = dict(COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                  architectures=["MixtralForCausalLM"])
    return MixtralConfig(**(params | overrides))


def qwen3_5_config(**overrides) -> Qwen3_5TextConfig:
    """Qwen3.5's hybrid at a tiny size: a linear-attention layer with 2 key heads of 8 serving 4 value heads of 12
    (two value heads per key head), then a gated full-attention layer of head_dim 16 with RoPE on its first 4
    channels (partial_rotary_factor 0.25); FFN 40. Two layers: at four, float32 rounding alone (transformers' own
    chunked and recurrent rules alike) moves the gradient norm by ~3e-5 of itself from its float64 value."""
    params = dict(COMMON, intermediate_size=40, head_dim=16, layer_types=["linear_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                  linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.25},
                  tie_word_embeddings=False, architectures=["Qwen3_5ForCausalLM"])
    return Qwen3_5TextConfig(**(params | overrides))


def qwen3_next_config(moe_text: bool = False, **overrides) -> Qwen3NextConfig | Qwen3_5MoeTextConfig:
    """Qwen3-Next (or, moe_text, Qwen3.5-MoE's language model) at a tiny size: qwen3_5_config's two hybrid layers
    (linear, then gated full attention) with a MoE in each: 4 experts of 16, top 2 (renormalised: Qwen3-Next's
    norm_topk_prob, Qwen3.5-MoE's rule), one shared expert of 24 behind its sigmoid gate. At three layers transformers'
    own float32 log-probs are ~3e-5 from its float64 ones."""
    params = dict(COMMON, head_dim=16, layer_types=["linear_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                  linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.25},
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  tie_word_embeddings=False)
    params.pop("intermediate_size")
    if moe_text:
        return Qwen3_5MoeTextConfig(**(params | {"architectures": ["Qwen3_5MoeForCausalLM"]} | overrides))
    return Qwen3NextConfig(**(params | {"norm_topk_prob": True, "architectures": ["Qwen3NextForCausalLM"]} | overrides))


def glm4_moe_config(**overrides) -> Glm4MoeConfig:
    """GLM-4.5 at a tiny size: layer 0 dense (FFN 56), layer 1 MoE (one stage each at PP=2); hidden 40 beside an
    attention 4 x 12 wide; q/k/v biases and QK-norm; RoPE on the first 6 of each head's 12 channels
    (partial_rotary_factor 0.5, 3 frequencies); 8 routed experts of 20 in 2 groups, the best group kept, top 3 of its
    4, renormalised and scaled by 2.5, one shared expert (GLM-4.5's scaling and shared expert); one MTP layer in the
    config (the checkpoint holds it only where a test adds it)."""
    params = dict(COMMON, hidden_size=40, intermediate_size=56, head_dim=12, attention_bias=True, use_qk_norm=True,
                  first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
                  moe_intermediate_size=20, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  num_nextn_predict_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.5},
                  tie_word_embeddings=False, architectures=["Glm4MoeForCausalLM"])
    return Glm4MoeConfig(**(params | overrides))


def gemma3_config(**overrides) -> Gemma3TextConfig:
    """Gemma 3 at a tiny size: 4 layers, local then global twice (sliding_window_pattern 2; one of each per stage at
    PP=2), a window of 4 tokens (padded_batch's rows are up to 12 long), local RoPE base 1e4, global 1e6 with linear
    scaling by 8 (4B and up), head_dim 16 beside hidden 32, query_pre_attn_scalar 24 (not head_dim), tied embeddings."""
    params = dict(COMMON, num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                  sliding_window_pattern=2, rope_parameters={
                      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                  tie_word_embeddings=True, architectures=["Gemma3ForCausalLM"])
    return Gemma3TextConfig(**(params | overrides))


def gemma3_mm_config(**text_overrides) -> Gemma3Config:
    """A multimodal Gemma 3 (Gemma3ForConditionalGeneration) at a tiny size of its own: a language model of 3 layers
    (two local, one global: sliding_window_pattern 3) with a 3-token window, hidden 24, head_dim 8, FFN 40,
    query_pre_attn_scalar 20, global RoPE linearly scaled by 4, vocabulary 131 (the image tokens at its end); a
    one-layer SigLIP tower of 16 over 16 x 16 images in patches of 4 without its head (as published), 4 tokens an
    image."""
    text = dict(COMMON, vocab_size=131, hidden_size=24, intermediate_size=40, num_hidden_layers=3, head_dim=8,
                sliding_window=3, query_pre_attn_scalar=20, sliding_window_pattern=3, rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}) | text_overrides
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=128,
                        eoi_token_index=129, image_token_index=130, architectures=["Gemma3ForConditionalGeneration"])


def qwen3_5_mm_config(moe: bool = False, **text_overrides) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """A published-style Qwen3.5 (Qwen3_5ForConditionalGeneration; moe: Qwen3_5MoeForConditionalGeneration) at a tiny
    size of its own: a language model of hidden 24, vocabulary 113, a linear-attention layer (2 key heads of 8, 2 value
    heads of 16) then a gated full-attention layer (4 query heads, 2 KV heads, head_dim 8, RoPE on 2 channels of each),
    FFN 36 (MoE: 3 experts of 12, top 2, a shared expert of 20), the head tied to the embedding (dense) or not (MoE);
    a one-block vision tower of 16 over patches of 4."""
    text = dict(vocab_size=113, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, max_position_embeddings=64, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
                linear_conv_kernel_dim=3, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.25})
    text |= (dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20)
             if moe else dict(intermediate_size=36))
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=24, num_position_embeddings=16)
    if moe:
        return Qwen3_5MoeConfig(text_config=text | text_overrides, vision_config=vision, tie_word_embeddings=False,
                                architectures=["Qwen3_5MoeForConditionalGeneration"])
    return Qwen3_5Config(text_config=text | text_overrides, vision_config=vision, tie_word_embeddings=True,
                         architectures=["Qwen3_5ForConditionalGeneration"])


# DeepSeek (multi-latent attention): qk_nope (12) != v_head_dim (10), rope dims 8 (4 frequencies). YaRN with
# original_max_position_embeddings 128 and rope_theta 1e4 puts the 4 frequencies in all three YaRN regimes (kept,
# blended half-way, divided by the factor). The MoE settings (A2's router) have topk (3) != 2 x topk_group (4).
DEEPSEEK_MLA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                    num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                    max_position_embeddings=512, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                    moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5)
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0}


def deepseek_v3_config(layers: int = 2, first_k_dense_replace: int | None = None, tied: bool = False,
                       **overrides) -> DeepseekV3Config:
    """DeepSeek-V3 style: q_lora_rank set, sigmoid router with e_score_correction_bias (noaux_tc). YaRN with
    mscale_all_dim 0.8 (!= mscale), so both the RoPE attention factor and the softmax scale differ from 1.
    first_k_dense_replace defaults to `layers` (every layer dense)."""
    dense = layers if first_k_dense_replace is None else first_k_dense_replace
    params = dict(DEEPSEEK_MLA, num_hidden_layers=layers, q_lora_rank=24, first_k_dense_replace=dense,
                  norm_topk_prob=True, topk_method="noaux_tc", tie_word_embeddings=tied,
                  rope_parameters=dict(DEEPSEEK_YARN, mscale_all_dim=0.8), architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV3Config(**(params | overrides))


def deepseek_v2_config(layers: int = 2, first_k_dense_replace: int | None = None, tied: bool = False,
                       **overrides) -> DeepseekV2Config:
    """DeepSeek-V2-Lite style: q_lora_rank null (a plain q_proj), softmax router, greedy top-k (transformers
    5.12's group_limited_greedy, DeepSeek-V2's, raises AttributeError 'num_experts' in DeepseekV2Moe).
    YaRN without mscale_all_dim: transformers' DeepseekV2Attention never multiplies the softmax scale by
    mscale^2 (DeepSeek's own code and SGLang do when mscale_all_dim is set; megarl follows them), so the
    two agree only there. first_k_dense_replace defaults to `layers` (every layer dense)."""
    dense = layers if first_k_dense_replace is None else first_k_dense_replace
    params = dict(DEEPSEEK_MLA, num_hidden_layers=layers, q_lora_rank=None, first_k_dense_replace=dense,
                  norm_topk_prob=False, topk_method="greedy", tie_word_embeddings=tied,
                  rope_parameters=dict(DEEPSEEK_YARN), architectures=["DeepseekV2ForCausalLM"])
    return DeepseekV2Config(**(params | overrides))


MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
                 "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
                 "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM, "MistralForCausalLM": MistralForCausalLM,
                 "MixtralForCausalLM": MixtralForCausalLM, "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
                 "Glm4MoeForCausalLM": Glm4MoeForCausalLM, "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
                 "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM}


MODEL_CLASSES["Gemma3ForCausalLM"] = Gemma3ForCausalLM
MODEL_CLASSES["Gemma3ForConditionalGeneration"] = Gemma3ForConditionalGeneration
MODEL_CLASSES["GptOssForCausalLM"] = GptOssForCausalLM
MODEL_CLASSES["Qwen3_5ForConditionalGeneration"] = Qwen3_5ForConditionalGeneration
MODEL_CLASSES["Qwen3_5MoeForConditionalGeneration"] = Qwen3_5MoeForConditionalGeneration


def save_random(config, path, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.architectures[0]](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's and GLM-4.5's routing bias: random, non-zero
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return str(path)


def save_random_for_recipe(config, path, seed: int = 0) -> str:
    """save_random with the character tokenizer and the generation config of the recipes' tasks (vocabulary 128)."""
    from transformers import GenerationConfig

    from megarl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config.vocab_size, config.pad_token_id, config.eos_token_id = 128, tokenizer.pad_token_id, tokenizer.eos_token_id
    save_random(config, path, seed=seed)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(path)
    return str(path)
