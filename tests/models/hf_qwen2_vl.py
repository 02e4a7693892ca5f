"""A tiny random Qwen2.5-VL written offline by transformers, image inputs for it, and transformers' log-probs.

Text: 4 query heads / 2 KV heads of head_dim 8 (mrope_section [2, 1, 1]: 2 rotary frequencies on the temporal
axis, 1 each on height and width), vocabulary 101 (not divisible by TP=2). Vision: patches of 2x2 pixels, 2x2
merge groups, windows of 8 pixels (2x2 merge groups), block 0 windowed and block 1 full attention.
"""

from __future__ import annotations

import torch

VOCAB = 101
VISION_START, VISION_END, IMAGE, VIDEO = 95, 96, 97, 98
PATCH, MERGE, TEMPORAL = 2, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def qwen2_vl_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, window_size=8,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False, architectures=["Qwen2_5_VLForConditionalGeneration"])


def save_random_qwen2_vl(path, seed: int = 0) -> str:
    """Norm weights around 1, the rest N(0, 0.3^2): next-token distributions far from uniform."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(qwen2_vl_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name or "ln_q" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


# Per image (t, h, w) in patches: 4x4 (one window), 4x8 (two windows), 6x4 (windows cut at the edge).
GRIDS = ([1, 4, 4], [1, 4, 8], [1, 6, 4])


def image_rows(seed: int = 3) -> list[dict]:
    """Three sequences: one image then text, text then two images, text only. Each: token ids (placeholders
    expanded, as the processor writes them) and its images' pixel_values / image_grid_thw."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(2, 90, (n,), generator=g).tolist()

    def image(grid):
        return [VISION_START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // MERGE ** 2) + [VISION_END]

    def pixels(grids):
        patches = sum(t * h * w for t, h, w in grids)
        return dict(pixel_values=torch.randn(patches, PATCH_DIM, generator=g), image_grid_thw=torch.tensor(grids))

    return [dict(ids=text(2) + image(GRIDS[0]) + text(5), **pixels([GRIDS[0]])),
            dict(ids=text(3) + image(GRIDS[1]) + text(2) + image(GRIDS[2]) + text(4), **pixels(list(GRIDS[1:]))),
            dict(ids=text(7), pixel_values=None, image_grid_thw=None)]


@torch.no_grad()
def hf_logprobs(model_dir: str, rows: list[dict]) -> list[torch.Tensor]:
    """transformers' log p(ids[t] | ids[<t]) for t >= 1 of each row, one row at a time (positions its own); the
    model class config.json names (Qwen2.5-VL's, Qwen3-VL's)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        ids = torch.tensor([row["ids"]])
        kwargs = {}
        if row["pixel_values"] is not None:
            kwargs = dict(pixel_values=row["pixel_values"], image_grid_thw=row["image_grid_thw"],
                          mm_token_type_ids=(ids == IMAGE).int())
        logits = model(input_ids=ids, **kwargs).logits[0].float()
        out.append(torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out
