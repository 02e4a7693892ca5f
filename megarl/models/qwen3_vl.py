"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration, model_type qwen3_vl): a Qwen3 language model (QK-norm,
no biases) with Qwen2.5-VL's way of taking images (qwen2_vl.py: the placeholder tokens' embeddings replaced by the
tower's features, M-RoPE position ids from the same mrope_positions, images through the batch) and three differences:
- its own vision tower (qwen3_vl_vision.py: learned position embeddings interpolated to each image, LayerNorm blocks
  with a GELU MLP, no windows);
- DeepStack: the tower's features from intermediate blocks (deepstack_visual_indexes) are added to the hidden states
  of the first len(deepstack_visual_indexes) language layers, layer j's output getting the j-th, at the image
  placeholder positions. Here they travel as megatron's `context` tensor (the cross-attention input, which the
  layers of this spec pass through untouched), stacked [levels, S, B, H] (a sequence-parallel slice under SP), so
  that full recompute reruns a layer with its own micro-batch's features; a forward hook on each of those layers
  adds its level. They are on the first pipeline stage, which must hold those layers (refused otherwise, as SGLang
  refuses a later stage starting before them);
- interleaved M-RoPE: rotary frequency i of each head follows the temporal axis unless i % 3 == 1 and
  i < 3 * mrope_section[1] (height) or i % 3 == 2 and i < 3 * mrope_section[2] (width), as transformers'
  apply_interleaved_mrope; megatron's MultimodalRotaryEmbedding cuts the frequencies in chunks instead, so the model
  computes its own table (InterleavedMRoPE).
The checkpoint's tensors are `model.language_model.*` (the text family's `model.*` names), `lm_head.weight` and
`model.visual.*`; megatron's tower is `visual.*`. Not supported: videos, context parallelism (as Qwen2.5-VL).
The mixture-of-experts variant is qwen3_vl_moe.py.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megarl.models.decoder import DecoderFamily, text_config
from megarl.models.qwen2_vl import Qwen2VL, Qwen2VLModel
from megarl.models.qwen3_vl_vision import VisionTower, vision_parameter_names
from megarl.models.sharding import WeightMap, replicated

LANGUAGE_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."


def interleaved_axes(mrope_section: list[int], frequencies: int) -> torch.Tensor:
    """[frequencies]: the M-RoPE axis (0 temporal, 1 height, 2 width) of each rotary frequency, interleaved."""
    axes = torch.zeros(frequencies, dtype=torch.long)
    axes[1:3 * mrope_section[1]:3] = 1
    axes[2:3 * mrope_section[2]:3] = 2
    return axes


class InterleavedMRoPE(nn.Module):
    """GPTModel's rotary_pos_emb for interleaved M-RoPE: forward(position_ids [3, B, S], mrope_section) -> the
    [S, B, 1, head_dim] angle table megatron's attention rotates by (rotate-half, both halves alike)."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.inv_freq = inv_freq  # megatron's float32 frequencies, a plain attribute as there (no bf16 cast)

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [3, B, S, head_dim / 2]
        axes = interleaved_axes(mrope_section, freqs.shape[-1]).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(freqs.shape[1:])[None])[0]
        return torch.cat([freqs, freqs], -1)[..., None, :].transpose(0, 1).contiguous()


class Qwen3VLModel(Qwen2VLModel):
    """Qwen2VLModel with Qwen3-VL's tower, DeepStack and interleaved M-RoPE (module docstring)."""

    vision_tower = VisionTower

    def __init__(self, config, transformer_layer_spec, *, vision: dict, image_token_id: int, **kwargs):
        levels, layers = len(vision.get("deepstack_visual_indexes", [])), len(transformer_layer_spec.layer_specs)
        if kwargs.get("pre_process", True) and layers < levels:
            raise ValueError(f"Qwen3-VL adds DeepStack features after its first {levels} language layers, which "
                             f"must be on the first pipeline stage; it has {layers}: give it more "
                             "(actor.parallel.pp_first_stage_layers) or use fewer stages")
        super().__init__(config, transformer_layer_spec, vision=vision, image_token_id=image_token_id, **kwargs)
        self.rotary_pos_emb = InterleavedMRoPE(self.rotary_pos_emb.inv_freq)
        if self.pre_process:
            for level in range(levels):
                self.decoder.layers[level].register_forward_hook(_add_deepstack(level), with_kwargs=True)

    def block_inputs(self, input_ids, pixel_values, image_grid_thw) -> tuple[torch.Tensor, dict]:
        words = self.words(input_ids)
        features, deepstack = self.visual(pixel_values, image_grid_thw)
        hidden = self.place_images(input_ids, words, features)
        if not deepstack:
            return hidden, {}
        # zeros beside the images: x + 0 is x, so the text positions keep their hidden states bit for bit
        zeros = torch.zeros_like(words)
        return hidden, {"context": torch.stack([self.place_images(input_ids, zeros, f) for f in deepstack])}


def _add_deepstack(level: int):
    def hook(layer, args, kwargs, output):
        context = kwargs.get("context")
        if context is None:
            return output
        return (output[0] + context[level], *output[1:])
    return hook


class Qwen3VL(Qwen2VL):
    name = "Qwen3-VL"
    architectures = ("Qwen3VLForConditionalGeneration", "qwen3_vl")
    qkv_bias = False
    qk_norm = True
    model_class = Qwen3VLModel

    def weight_maps(self, hf: dict, tp: int) -> list[WeightMap]:
        vision = [WeightMap(f"visual.{n}", (VISION_PREFIX + n,), **replicated())
                  for n in vision_parameter_names(hf["vision_config"])]
        text = DecoderFamily.weight_maps(self, text_config(hf), tp)
        return vision + [dataclasses.replace(m, hf=tuple(language_name(n) for n in m.hf)) for m in text]


def language_name(name: str) -> str:
    """The checkpoint's name of a language-model tensor the text family names `model.*` (lm_head as it is)."""
    return LANGUAGE_PREFIX + name[len("model."):] if name.startswith("model.") else name


FAMILY = Qwen3VL()
