"""A tiny random Qwen2.5-VL with the character tokenizer and an image processor, built offline for tests and CPU
demos: `build_tiny_vl_model(out_dir)` writes config.json, model.safetensors, the tokenizer (megarl/models/tiny.py's
characters plus Qwen's vision tokens and a plain chat template that writes an image as its vision tokens) and
preprocessor_config.json (patches of 2x2 pixels, 2x2 merge groups; images resized to 16..1024 pixels).
`python -m megarl.models.tiny_vl OUT` writes one (configs/quickstart_vl.yaml's model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# role: content lines; a content list writes its images as the vision tokens and its texts as they are
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
PATCH, MERGE, TEMPORAL = 2, 2, 2


def build_tiny_vl_tokenizer():
    from megarl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_vl_model(out_dir: str | Path, hidden_size: int = 32, layers: int = 2, seed: int = 0,
                        min_pixels: int = 16, max_pixels: int = 1024, shape: dict | None = None,
                        dtype: torch.dtype = torch.float32, device: str = "cpu", vision_init_std: float = 0.0) -> Path:
    """Write the model directory (overwriting files of the same names); returns its path. `shape`: text_config and
    vision_config fields over the tiny ones, and top-level fields (a real model's shapes with this tokenizer and its
    vocabulary: benchmarks/vl_grpo.py's Qwen2.5-VL-3B); `dtype`, `device`: the random model's, as built and saved.
    `vision_init_std` > 0 draws the tower's matrices with that std: transformers' 0.02 gives a tiny tower whose
    features differ between images by ~0.002 against text embeddings of 0.02, which a tiny policy barely reads."""
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tiny_vl_tokenizer()
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    head_dim = 8
    shape = dict(shape or {})
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=hidden_size // head_dim, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                  patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, window_size=8,
                  fullatt_block_indexes=[1], in_channels=3)
    config = Qwen2_5_VLConfig(
        text_config=text | shape.pop("text_config", {}), vision_config=vision | shape.pop("vision_config", {}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        **{"tie_word_embeddings": False, "architectures": ["Qwen2_5_VLForConditionalGeneration"]} | shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
        if vision_init_std > 0:
            with torch.no_grad():
                for p in model.model.visual.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, vision_init_std)
    vision = config.vision_config
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                             temporal_patch_size=vision.temporal_patch_size,
                             size={"shortest_edge": min_pixels, "longest_edge": max_pixels}).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random Qwen2.5-VL model directory, offline.")
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vision-init-std", type=float, default=0.0,
                        help="the tower's matrices' std (0: transformers')")
    args = parser.parse_args(argv)
    print(build_tiny_vl_model(args.out_dir, args.hidden_size, args.layers, args.seed,
                              vision_init_std=args.vision_init_std))


if __name__ == "__main__":
    main()
