"""Images in SGLang requests (Qwen2.5-VL, sglang 0.5.17): SGLang generates from megarl's own processed inputs, the
ones the trainer computes its log-probs on, not from its own processing of the images.

A row of a /generate request carries `input_ids` (its prompt with every image's placeholder tokens expanded, plus
its tokens so far when a partial rollout resumes) and ONE image item holding all of the row's images, in SGLang's
"processor_output" format (base_processor._validate_one_modality refuses a processor_output item beside another):
  {"format": "processor_output", "pixel_values": [patches, features], "image_grid_thw": [images, 3],
   "mrope_positions": [3, T], "mrope_position_delta": [[max + 1 - T]]}
With input_ids given and every item preprocessed, SGLang takes the ids as they are (load_mm_data's early return:
nothing is decoded or re-tokenised), cuts the item into one item per image at the runs of image tokens and the grids
(get_new_expanded_mm_items), and takes the M-RoPE positions as given (qwen_vl.py: _get_precomputed_mrope_from_output):
megarl's own (megarl.models.qwen2_vl.mrope_positions, as the trainer's engine computes them) over the row's whole
input; the positions of generated tokens continue from the largest + 1 (the delta).

Tensors over HTTP: the in-process sglang.Engine takes torch tensors in the item; the HTTP server parses JSON and its
processor_output path hands the values on as they are (a nested list would reach the tower's torch.cat). megarl
sends each tensor as {"megarl_tensor": base64 of its bytes, "dtype", "shape"} and a processor of its own inside the
server (megarl/rollout/sglang_processors, named by SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE: sglang_server.py) decodes
them before SGLang's Qwen-VL processor runs.

A batch request's image_data has one list per row: [item] for a row with images, [None] for a text-only one
(GenerateReqInput._normalize_image_data reads a list of lists only when its first entry is a list).

The image placeholder token is never sampled (as in the hf engine: a response placeholder would stand for image
features the row does not have, and the trainer's M-RoPE ids refuse it): a logit bias bans it. SGLang adds the bias
to the logits before it computes log-probs, so its log-probs are those of the distribution it samples from, the
raw logits' minus log(1 - p(placeholder)): ~0 for a trained model, ~0.01 for a random one over ~100 tokens.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch

from megarl.rollout.base import ImageInputs

TENSOR_KEY = "megarl_tensor"
BANNED = -1e9  # the logit bias of a token never to be sampled (JSON carries no -inf)
PROCESSOR_PACKAGE = "megarl.rollout.sglang_processors"  # SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE of a VL server


def encode_tensor(t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    data = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return {TENSOR_KEY: base64.b64encode(data.numpy().tobytes()).decode(), "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}


def decode_tensor(value: dict) -> torch.Tensor:
    dtype = getattr(torch, value["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"encoded tensor of unknown dtype {value['dtype']!r}")
    data = bytearray(base64.b64decode(value[TENSOR_KEY]))
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(value["shape"])


def decode_item(item):
    """An image item with its encoded tensors decoded (anything else as it is)."""
    if not isinstance(item, dict):
        return item
    return {k: decode_tensor(v) if isinstance(v, dict) and TENSOR_KEY in v else v for k, v in item.items()}


def vision_fields(model_path: str) -> tuple[int, int]:
    """(image_token_id, spatial_merge_size) of a vision-language model directory's config.json."""
    hf = json.loads((Path(model_path) / "config.json").read_text())
    if "vision_config" not in hf or "image_token_id" not in hf:
        raise ValueError(f"{model_path}: config.json has no vision_config / image_token_id, so its model takes no "
                         "images (a vision-language model, e.g. Qwen2.5-VL, does)")
    return hf["image_token_id"], hf["vision_config"]["spatial_merge_size"]


def image_item(input_ids: list[int], images: ImageInputs, image_token_id: int, merge_size: int) -> dict:
    """The processor_output item of one row (module docstring). Raises ValueError when the row's runs of image
    placeholder tokens do not match its images' grids (SGLang would otherwise misplace or drop features)."""
    from megarl.models.qwen2_vl import mrope_positions

    positions = mrope_positions(torch.tensor(input_ids), images.image_grid_thw, image_token_id, merge_size)
    delta = int(positions.max()) + 1 - len(input_ids) if len(input_ids) else 0
    return {"format": "processor_output", "pixel_values": encode_tensor(images.pixel_values),
            "image_grid_thw": encode_tensor(images.image_grid_thw.long()), "mrope_positions": encode_tensor(positions),
            "mrope_position_delta": encode_tensor(torch.tensor([[delta]]))}


def placeholder_ban(image_token_id: int) -> dict:
    """Sampling parameters that keep SGLang from sampling the image placeholder token (module docstring)."""
    return {"logit_bias": {str(image_token_id): BANNED}}


def request_image_data(items: list[dict | None]) -> list[list] | None:
    """A batch request's image_data from each row's item (None: text only); None when no row has images."""
    if all(item is None for item in items):
        return None
    return [[item] for item in items]
