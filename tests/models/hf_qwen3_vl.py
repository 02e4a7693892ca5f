"""A tiny random Qwen3-VL written offline by transformers (the image rows and transformers' log-probs are
hf_qwen2_vl.py's: the same token ids, patches and grids).

Text: 4 layers, 4 query heads / 2 KV heads of head_dim 16, mrope_section [4, 2, 2] (8 rotary frequencies: interleaved
T H W T H W T T, where chunks would be T T T T H H W W), vocabulary 101 (not divisible by TP=2). Vision: 3 blocks,
patches of 2x2 pixels, 2x2 merge groups, a 4x4 grid of position embeddings (interpolated to 4, 6 and 8 rows or
columns), DeepStack from blocks 0 and 2 into language layers 0 and 1 (both on the first of 2 pipeline stages).
"""

from __future__ import annotations

import torch

from tests.models.hf_qwen2_vl import IMAGE, MERGE, PATCH, TEMPORAL, VIDEO, VISION_END, VISION_START, VOCAB


def qwen3_vl_config(layers: int = 4):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=1, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 2], in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False, architectures=["Qwen3VLForConditionalGeneration"])


def save_random_qwen3_vl(path, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Norm weights around 1, the rest N(0, 0.3^2): next-token distributions far from uniform."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(qwen3_vl_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    return str(path)
