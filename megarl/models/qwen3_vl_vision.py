"""The Qwen3-VL vision tower (transformers' Qwen3VLVisionModel), in plain torch, replicated over TP as Qwen2.5-VL's
(qwen2_vl_vision.py: why, and how its gradient stays whole), whose attention and 2D rotary positions it reuses.

Module and parameter names are transformers' (`model.visual.` + these in the checkpoint, `visual.` + these in megatron):
  patch_embed.proj              Conv3d over (temporal_patch_size, patch_size, patch_size) patches, with a bias
  pos_embed                     a learned side x side grid of position embeddings (side^2 = num_position_embeddings),
                                bilinearly interpolated to each image's h x w patches and added to the patches
  blocks.{i}.norm1 / norm2      LayerNorm, eps 1e-6
  blocks.{i}.attn.qkv / proj    multi-head self-attention with biases and 2D rotary positions (row, column), each
                                frame of each image attending within itself (no windows)
  blocks.{i}.mlp                linear_fc1, hidden_act (gelu_pytorch_tanh), linear_fc2, with biases
  merger                        LayerNorm over each patch, 2x2 neighbouring patches concatenated -> linear_fc1, GELU,
                                linear_fc2: one feature of the language model's width per merge group
  deepstack_merger_list.{j}     the same on the output of block deepstack_visual_indexes[j], but its LayerNorm over the
                                concatenated merge group: the features qwen3_vl.py adds after language layer j
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megarl.models.qwen2_vl_vision import PatchEmbed, VisionAttention, image_bounds, patch_positions, rotary_cos_sin

VISION_NORM_EPS = 1e-6  # transformers' LayerNorms in the tower: fixed, not read from the config
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu's approximate


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, approximate: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, approximate: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=VISION_NORM_EPS), nn.LayerNorm(dim, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, hidden, approximate)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """norm_merged: the LayerNorm over a whole merge group (DeepStack's mergers) rather than over each patch."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, norm_merged: bool):
        super().__init__()
        self.merged, self.norm_merged = dim * merge_size ** 2, norm_merged
        self.norm = nn.LayerNorm(self.merged if norm_merged else dim, eps=VISION_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.norm_merged else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def interpolated_positions(grid_thw: torch.Tensor, side: int, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear interpolation of a side x side grid to each image's patches, in the processor's patch order:
    (indices [4, patches] into the grid, weights [4, patches]) of the four corners (top-left, top-right,
    bottom-left, bottom-right). An image of h rows samples the grid at linspace(0, side - 1, h), columns alike."""
    indices, weights = [], []
    for image in grid_thw:
        _, h, w = image.tolist()
        rows, cols = patch_positions(image[None], merge_size).unbind(-1)
        at_row, at_col = torch.linspace(0, side - 1, h)[rows], torch.linspace(0, side - 1, w)[cols]
        top, left = at_row.int(), at_col.int()
        bottom, right = (top + 1).clamp(max=side - 1), (left + 1).clamp(max=side - 1)
        dh, dw = at_row - top, at_col - left
        indices.append(torch.stack([top * side + left, top * side + right,
                                    bottom * side + left, bottom * side + right]))
        weights.append(torch.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw]))
    return torch.cat(indices, 1).long(), torch.cat(weights, 1)


class VisionTower(nn.Module):
    """pixel_values [patches, C * T * P * P] (the processor's rows) and image_grid_thw [images, 3] -> (the features
    [sum(t*h*w) / merge^2, out_hidden_size], one per merge group, images in order; and the DeepStack features, one
    tensor of that shape per deepstack_visual_indexes entry)."""

    def __init__(self, vision: dict):
        super().__init__()
        dim, heads = vision["hidden_size"], vision["num_heads"]
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"Qwen3-VL vision tower with hidden_act={act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)} only)")
        self.merge_size = vision["spatial_merge_size"]
        self.side = int(vision["num_position_embeddings"] ** 0.5)
        self.deepstack = list(vision.get("deepstack_visual_indexes", []))
        self.patch_embed = PatchEmbed(vision["patch_size"], vision["temporal_patch_size"],
                                      vision.get("in_channels", 3), dim, bias=True)
        self.pos_embed = nn.Embedding(vision["num_position_embeddings"], dim)
        self.rotary_dim = dim // heads // 2  # half of each head rotates by row, half by column
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, vision["intermediate_size"], ACTIVATIONS[act])
                                    for _ in range(vision["depth"]))
        out = vision["out_hidden_size"]
        self.merger = PatchMerger(dim, out, self.merge_size, norm_merged=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(dim, out, self.merge_size, norm_merged=True)
                                                   for _ in self.deepstack)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grid_thw = grid_thw.cpu()
        x = self.patch_embed(pixel_values)
        indices, weights = interpolated_positions(grid_thw, self.side, self.merge_size)
        # float32 weights, as transformers multiplies them: a bf16 table's products are float32 before the sum
        positions = (self.pos_embed(indices.to(x.device)) * weights.to(x.device)[..., None]).sum(0)
        x = x + positions.to(x.dtype)
        cos, sin = rotary_cos_sin(patch_positions(grid_thw, self.merge_size).to(x.device), self.rotary_dim)
        bounds = image_bounds(grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, bounds, cos, sin)
            if i in self.deepstack:
                deepstack.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return self.merger(x), deepstack


def vision_parameter_names(vision: dict) -> list[str]:
    """Every parameter of the tower (VisionTower's names, also the checkpoint's after `model.visual.`)."""
    affine = ("weight", "bias")
    levels = len(vision.get("deepstack_visual_indexes", []))
    mergers = ["merger"] + [f"deepstack_merger_list.{j}" for j in range(levels)]
    names = [f"patch_embed.proj.{p}" for p in affine] + ["pos_embed.weight"]
    for b in range(vision["depth"]):
        names += [f"blocks.{b}.{m}.{p}" for m in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1",
                                                  "mlp.linear_fc2") for p in affine]
    return names + [f"{m}.{part}.{p}" for m in mergers for part in ("norm", "linear_fc1", "linear_fc2") for p in affine]
