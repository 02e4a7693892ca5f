"""Prompts with images, for vision-language policies (Qwen2.5-VL: megarl/models/qwen2_vl.py).

A prompt row carries `images` beside its `prompt` (a string or chat messages): a list whose entries are a path
(relative to the prompt file's directory, or absolute), raw bytes, or a dict {'bytes': ...} / {'path': ...} (the
layout HF datasets write to parquet). The text marks where each image goes with `<image>` (verl's convention);
images without a marker go before the text of the first user message.

The model directory's image processor (preprocessor_config.json; transformers' PIL backend, which needs no
torchvision) makes each image's pixel_values [patches, C*T*P*P] and grid (t, h, w) in patches, resized to hold
between min_pixels and max_pixels. The prompt's token ids hold the image placeholder token (<|image_pad|>)
t*h*w / merge_size^2 times per image, between <|vision_start|> and <|vision_end|>, exactly as transformers' Qwen2.5-VL
processor expands them: the rollout and the loss see the same ids and nothing is re-tokenised. Placeholder tokens
are prompt tokens, never trained on (loss_mask_without_images also clears them in any trained span, e.g. an image a
tool returned in a multi-turn rollout).

An image that is missing or unreadable raises an InputError naming the prompt file, the row and the image.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

from megarl.data.files import InputError

IMAGE_MARKER = "<image>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_SLOT = VISION_START + IMAGE_PAD + VISION_END  # one image in the rendered text, before expansion


def load_image(ref, base_dir: str | Path, where: str):
    """An RGB PIL image from a path, bytes, a data: URL, {'bytes'|'path': ...} or a PIL image; `where` names the row
    and image."""
    from PIL import Image

    if isinstance(ref, Image.Image):  # a tool's answer (megarl.rollout.tools.ToolResult)
        return ref.convert("RGB")
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    try:
        if isinstance(ref, (bytes, bytearray)):
            source = io.BytesIO(ref)
        elif isinstance(ref, str) and ref.startswith("data:"):
            source = io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))
        elif isinstance(ref, str) and ref:
            source = Path(base_dir) / ref
            if not source.is_file():
                raise InputError(f"{where}: image file {source} does not exist")
        else:
            raise InputError(f"{where}: an image must be a path, bytes or {{'bytes'|'path': ...}}, got {ref!r:.80}")
        with Image.open(source) as image:
            return image.convert("RGB")
    except InputError:
        raise
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, ValueError, DecompressionBombError ...
        raise InputError(f"{where}: image {str(ref)[:80]!r} is not a readable image ({type(e).__name__}: {e})") from None


def with_image_slots(prompt: str | list[dict], count: int) -> str | list[dict]:
    """The prompt with each `<image>` marker replaced by the vision tokens; images without a marker go in front of
    the first user message. More markers than images is an error (raised by the caller with the row)."""
    def text_of(p):
        return p if isinstance(p, str) else "".join(m["content"] for m in p)

    markers = text_of(prompt).count(IMAGE_MARKER)
    if markers > count:
        raise ValueError(f"the prompt has {markers} {IMAGE_MARKER} markers but the row {count} images")
    front = IMAGE_SLOT * (count - markers)
    if isinstance(prompt, str):
        return front + prompt.replace(IMAGE_MARKER, IMAGE_SLOT)
    messages, placed = [], not front
    for m in prompt:
        content = m["content"].replace(IMAGE_MARKER, IMAGE_SLOT)
        if not placed and m["role"] == "user":
            content, placed = front + content, True
        messages.append(dict(m, content=content))
    return messages


class ImagePrompts:
    """The model directory's image processor and the tokenizer's vision tokens: rendered prompt text + images ->
    expanded token ids, pixel_values, image_grid_thw. `min_pixels` / `max_pixels` (data.min_pixels / data.max_pixels)
    bound each resized image; 0 keeps the directory's bound."""

    def __init__(self, model_dir: str | Path, tokenizer, min_pixels: int = 0, max_pixels: int = 0):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        if not (Path(model_dir) / "preprocessor_config.json").exists():
            raise InputError(f"{model_dir}: no preprocessor_config.json (the image processor of a vision-language "
                             "model)")
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.merge = self.processor.merge_size
        size = self.processor.size  # the directory's bounds (its min_pixels / max_pixels or size)
        self.min_pixels, self.max_pixels = min_pixels or size.shortest_edge, max_pixels or size.longest_edge
        # smart_resize makes each side a multiple of patch_size * merge_size and keeps at least one such square
        square = (self.processor.patch_size * self.merge) ** 2
        if self.max_pixels < max(square, self.min_pixels):
            raise InputError(f"data.min_pixels={self.min_pixels}, data.max_pixels={self.max_pixels} (0 = {model_dir}'s "
                             f"preprocessor_config.json): max_pixels must be >= min_pixels and >= {square} (one "
                             "merged patch, (patch_size * merge_size)^2)")
        self.tokenizer = tokenizer
        ids = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
        if tokenizer.unk_token_id in ids or None in ids:
            raise InputError(f"{model_dir}: the tokenizer has no {VISION_START} / {IMAGE_PAD} / {VISION_END} tokens")
        self.image_token_id = ids[1]

    def encode(self, text: str, images: list, where: str) -> dict:
        """{'prompt_ids', 'pixel_values', 'image_grid_thw'} of rendered text holding one IMAGE_SLOT per image."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        slots = ids.count(self.image_token_id)
        if slots != len(images):
            raise InputError(f"{where}: the rendered prompt has {slots} image slots for {len(images)} images")
        expanded, pixel_values, grids = self.expand(ids, images)
        return {"prompt_ids": expanded, "pixel_values": pixel_values, "image_grid_thw": grids}

    def expand(self, ids: list[int], images: list) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Token ids holding one image placeholder per image (in order) -> (the ids with each placeholder repeated
        t*h*w / merge^2 times, pixel_values, image_grid_thw) of the images (PIL, RGB)."""
        out = self.processor(images=images, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                             return_tensors="pt")
        grids = out["image_grid_thw"]
        counts = iter((grids.prod(-1) // self.merge ** 2).tolist())
        expanded = []
        for token in ids:
            expanded += [token] * next(counts) if token == self.image_token_id else [token]
        return expanded, out["pixel_values"], grids


def image_examples(examples: list[dict], tokenizer, image_prompts: ImagePrompts, base_dir: str | Path,
                   chat_template: bool, system_prompt: str = "") -> list[dict]:
    """Examples with `prompt` rendered (vision tokens in place), `prompt_ids` expanded, `pixel_values` and
    `image_grid_thw` (None for a row without images). Each example's `origin` (file, row) names it in errors."""
    from megarl.data.dataset import render_prompt

    out = []
    for i, ex in enumerate(examples):
        where = getattr(ex, "origin", f"example {i}")
        refs = ex.get("images") or []
        if not isinstance(refs, list):
            raise InputError(f"{where}: field 'images' must be a list, got {type(refs).__name__}")
        try:
            prompt = with_image_slots(ex["prompt"], len(refs))
        except ValueError as e:
            raise InputError(f"{where}: {e}") from None
        images = [load_image(ref, base_dir, f"{where}, image {k}") for k, ref in enumerate(refs)]
        text = render_prompt(tokenizer, prompt, chat_template, system_prompt)
        if images:
            encoded = image_prompts.encode(text, images, where)
        else:
            encoded = {"prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "pixel_values": None,
                       "image_grid_thw": None}
        out.append(dict(ex, prompt=text, **encoded))
    return out


def loss_mask_without_images(loss_mask: torch.Tensor, tokens: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """loss_mask with every image placeholder position cleared: image features are inputs, never targets."""
    return loss_mask * (tokens != image_token_id)
