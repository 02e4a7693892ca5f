"""The Qwen2.5-VL vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel), in plain torch.

It is REPLICATED on every tensor-parallel rank (each rank runs the whole tower on every image): the tower is small
beside the language model (about 0.67B of Qwen2.5-VL-7B's 8.3B parameters) and this keeps its weights HF-shaped, so
its weight maps are identities. Its gradient is whole on every TP rank without any reduction: the language model's
first column-parallel layer all-reduces the gradient of its input (the embeddings the tower's features are scattered
into), and megatron counts parameters without a tensor-parallel attribute once (TP rank 0) in the grad norm.
Splitting the tower over TP (megatron's column/row-parallel linears) is the next step for large towers.

Module and parameter names are transformers' (`visual.` + these), so the checkpoint's tensors load by name:
  patch_embed.proj              Conv3d over (temporal_patch_size, patch_size, patch_size) patches, no bias
  blocks.{i}.norm1 / norm2      RMSNorm, eps 1e-6
  blocks.{i}.attn.qkv / proj    multi-head self-attention with biases and 2D rotary positions (row, column)
  blocks.{i}.mlp                SwiGLU with biases (gate_proj, up_proj, down_proj)
  merger.ln_q, merger.mlp.0/2   RMSNorm, then 2x2 neighbouring patches concatenated -> Linear, GELU, Linear
Blocks in fullatt_block_indexes attend over a whole image; the others within windows of window_size pixels. The
processor orders each image's patches so that every 2x2 merge group is consecutive; the tower regroups merge groups
window by window before the blocks and restores the processor's order after the merger.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VISION_NORM_EPS = 1e-6  # transformers' Qwen2_5_VLRMSNorm in the tower: fixed, not read from the config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = VISION_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on [tokens, heads, head_dim] with halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
    computed in float32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, -1)
    return (x32 * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).reshape(tokens, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Each span of cu_seqlens (an image, or a window) attends within itself only.
        out = [F.scaled_dot_product_attention(*(t[start:end].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
               for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        return self.proj(torch.cat(out).reshape(tokens, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, hidden)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, dim: int, bias: bool = False):
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=self.shape[1:], stride=self.shape[1:], bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A conv whose stride is its kernel over one patch each is a matmul; kept a Conv3d for the HF weight shape.
        return self.proj(pixels.reshape(-1, *self.shape).to(self.proj.weight.dtype)).flatten(1)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, out_dim: int, merge_size: int):
        super().__init__()
        self.merged = dim * merge_size ** 2
        self.ln_q = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


def patch_positions(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """[patches, 2]: each patch's (row, column) in its image, in the processor's order (merge groups of
    merge_size x merge_size patches consecutive, row-major within and between groups; frames repeat)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge_size, merge_size, 1, 1).expand(-1, -1, w // merge_size, merge_size)
        cols = torch.arange(w).view(1, 1, w // merge_size, merge_size).expand(h // merge_size, merge_size, -1, -1)
        # (group row, row in group, group col, col in group) -> (group row, group col, row in group, col in group)
        pos = torch.stack([rows, cols], -1).permute(0, 2, 1, 3, 4).reshape(-1, 2)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, 1, 2 * rotary_dim] of the 2D rotary positions of patches at `positions` [patches, 2]
    (row, column): rotary_dim / 2 frequencies rotate by row, as many by column, over both halves of each head.
    The float32 frequencies are computed here, not kept in a buffer: the bf16 cast of the model would round them."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, device=positions.device).float() / rotary_dim)
    angles = (positions.unsqueeze(-1).float() * inv_freq).flatten(1)  # [patches, rotary_dim]: rows, then columns
    angles = torch.cat([angles, angles], -1).unsqueeze(1)
    return angles.cos(), angles.sin()


def window_order(grid_thw: torch.Tensor, merge_size: int, window_merged: int) -> tuple[torch.Tensor, list[int]]:
    """The merge groups regrouped window by window (windows of window_merged x window_merged merge groups, row-major,
    the last row/column of windows cut short at the image's edge), and the window boundaries in patches."""
    order, bounds, first = [], [0], 0
    unit = merge_size ** 2
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge_size, w // merge_size
        groups = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in groups:
            for r in range(0, gh, window_merged):
                for c in range(0, gw, window_merged):
                    window = frame[r:r + window_merged, c:c + window_merged].reshape(-1)
                    order.append(window + first)
                    bounds.append(bounds[-1] + window.numel() * unit)
        first += t * gh * gw
    return torch.cat(order), bounds


def image_bounds(grid_thw: torch.Tensor) -> list[int]:
    """Patch boundaries of each frame of each image (full-attention blocks attend within a frame)."""
    bounds = [0]
    for t, h, w in grid_thw.tolist():
        bounds += [bounds[-1] + h * w * (i + 1) for i in range(t)]
    return bounds


class VisionTower(nn.Module):
    """pixel_values [patches, C * T * P * P] (the processor's rows) and image_grid_thw [images, 3] -> one feature
    of the language model's width per merge group, images in order ([sum(t*h*w) / merge^2, out_hidden_size])."""

    def __init__(self, vision: dict):
        super().__init__()
        dim, heads = vision["hidden_size"], vision["num_heads"]
        self.merge_size = vision["spatial_merge_size"]
        self.window_merged = vision["window_size"] // self.merge_size // vision["patch_size"]
        self.full_attention = set(vision["fullatt_block_indexes"])
        self.patch_embed = PatchEmbed(vision["patch_size"], vision["temporal_patch_size"],
                                      vision.get("in_channels", vision.get("in_chans", 3)), dim)
        self.rotary_dim = dim // heads // 2  # half of each head rotates by row, half by column
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, vision["intermediate_size"])
                                    for _ in range(vision["depth"]))
        self.merger = PatchMerger(dim, vision["out_hidden_size"], self.merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid_thw = grid_thw.cpu()
        unit = self.merge_size ** 2
        order, window_bounds = window_order(grid_thw, self.merge_size, self.window_merged)
        x = self.patch_embed(pixel_values)
        x = x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)
        positions = patch_positions(grid_thw, self.merge_size).to(x.device)
        positions = positions.reshape(-1, unit, 2)[order.to(x.device)].reshape(positions.shape)
        cos, sin = rotary_cos_sin(positions, self.rotary_dim)
        full_bounds = image_bounds(grid_thw)
        for i, block in enumerate(self.blocks):
            x = block(x, full_bounds if i in self.full_attention else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(order).to(x.device)]
