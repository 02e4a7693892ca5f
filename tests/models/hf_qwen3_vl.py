"""A tiny random Qwen3-VL written offline by transformers (the image rows and transformers' log-probs are
hf_qwen2_vl.py's: the same token ids, patches and grids).

Text: 4 layers, 4 query heads / 2 KV heads of head_dim 16, mrope_section [4, 2, 2] (8 rotary frequencies: interleaved
T H W T H W T T, where chunks would be T T T T H H W W), vocabulary 101 (not divisible by TP=2). Vision: 3 blocks,
patches of 2x2 pixels, 2x2 merge groups, a 4x4 grid of position embeddings (interpolated to 4, 6 and 8 rows or
columns), DeepStack from blocks 0 and 2 into language layers 0 and 1 (both on the first of 2 pipeline stages). The
MoE variant: 4 experts of width 8 (2 x 8 != hidden 32: the stacked layouts tell apart), top-2, in every layer.
"""

from __future__ import annotations

import torch

from tests.models.hf_qwen2_vl import IMAGE, MERGE, PATCH, TEMPORAL, VIDEO, VISION_END, VISION_START, VOCAB


def qwen3_vl_config(moe: bool = False):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8) if moe else {}
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(**experts, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=1, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 2], in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
        architectures=["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"])


def save_random_qwen3_vl(path, seed: int = 0, dtype: torch.dtype = torch.float32, moe: bool = False) -> str:
    """Norm weights around 1, the rest N(0, 0.3^2): next-token distributions far from uniform. The MoE model's
    stacked experts are written input-major, as the published checkpoints hold them (transformers 5 saves them
    output-major and reads both)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)(qwen3_vl_config(moe))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    if moe:
        file = f"{path}/model.safetensors"
        tensors = {n: t.transpose(1, 2).contiguous() if n.endswith(STACKED) else t for n, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


STACKED = (".experts.gate_up_proj", ".experts.down_proj")  # [experts, out, in] as transformers 5 saves them
