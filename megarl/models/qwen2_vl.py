"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): a Qwen2 language model with multimodal rotary
positions (M-RoPE) whose input embeddings at the image placeholder tokens are replaced by the vision tower's features
(megarl/models/qwen2_vl_vision.py, replicated over TP: its docstring says why and what that costs).

The language model is megatron's GPTModel with position_embedding_type='mrope' (megatron-core's
MultimodalRotaryEmbedding): position_ids are [3, rows, tokens] (temporal, height, width; text tokens carry the
same position three times), and the rotary channels of each head are split by rope_parameters.mrope_section
(doubled over the two halves of the head) among the three, as transformers' apply_multimodal_rotary_pos_emb does.
mrope_positions() computes those ids from the token ids and image grids (transformers' get_rope_index for images).
Its layers follow the Qwen2 text family's TP rules (q/k/v biases; TP must divide the key/value heads).

config.json comes in two spellings: the published checkpoints keep the text fields at the top level with
rope_scaling {"type": "mrope", "mrope_section": [...]}; transformers >= 5 writes them under text_config with
rope_parameters. Both are read. The checkpoint's tensors are `model.*` / `lm_head.weight` (the text family's
names) and `visual.*` (the tower's, as named there).

In the engine (megatron_engine.py, packing.py): with_model_inputs adds each row's M-RoPE ids to the batch, packing
lays them out per sequence and gathers the micro-batch's images; under pipeline parallelism the tower is on the first
stage only. Not supported: context parallelism (refused by name: the M-RoPE table would have to be cut per CP chunk)
and videos (pixel_values_videos).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel

from megarl.models.decoder import DecoderFamily, rope_parameters, text_config
from megarl.models.qwen2_vl_vision import VisionTower
from megarl.models.sharding import WeightMap, replicated
from megarl.protocol import Batch

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl")


def mrope_section(hf: dict) -> list[int]:
    params = rope_parameters(text_config(hf))
    section = params.get("mrope_section")
    if not section:
        raise ValueError("Qwen2.5-VL config.json has no rope_parameters.mrope_section (or rope_scaling.mrope_section)")
    return list(section)


def vision_parameter_names(vision: dict) -> list[str]:
    """Every parameter of the tower (VisionTower's names, also the checkpoint's after `visual.`)."""
    names = ["patch_embed.proj.weight", "merger.ln_q.weight"] + [
        f"merger.mlp.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")]
    for b in range(vision["depth"]):
        names += [f"blocks.{b}.norm1.weight", f"blocks.{b}.norm2.weight"]
        names += [f"blocks.{b}.attn.{m}.{p}" for m in ("qkv", "proj") for p in ("weight", "bias")]
        names += [f"blocks.{b}.mlp.{m}.{p}" for m in ("gate_proj", "up_proj", "down_proj") for p in ("weight", "bias")]
    return names


class Qwen2VLModel(GPTModel):
    """GPTModel with the vision tower on the first pipeline stage. forward(input_ids, position_ids [3, B, S],
    attention_mask, ..., pixel_values=None, image_grid_thw=None): the embeddings at the image_token_id positions are
    the tower's features of the images, in row-major order of those positions (transformers' masked_scatter)."""

    has_vision_tower = True  # actor.freeze_vision_tower applies
    vision_tower = VisionTower  # (vision_config) -> module: (pixel_values, image_grid_thw) -> features

    def __init__(self, config, transformer_layer_spec, *, vision: dict, image_token_id: int, **kwargs):
        if config.context_parallel_size > 1:
            raise ValueError(f"actor.parallel.cp={config.context_parallel_size}: context parallelism with M-RoPE "
                             "(Qwen2.5-VL) is not supported yet; use cp=1")
        super().__init__(config, transformer_layer_spec, **kwargs)
        self.image_token_id = image_token_id
        self.visual = self.vision_tower(vision).to(config.params_dtype) if self.pre_process else None

    def words(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [B, S, H], whole on every TP rank: under SP megatron's vocab-parallel embedding
        would reduce-scatter its output over the sequence instead (an all-reduce here; place_images scatters,
        after the images are in place)."""
        table, scatters = self.embedding.word_embeddings, self.embedding.word_embeddings.reduce_scatter_embeddings
        table.reduce_scatter_embeddings = False
        try:
            return table(input_ids)
        finally:
            table.reduce_scatter_embeddings = scatters

    def place_images(self, input_ids: torch.Tensor, words: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """`words` [B, S, H] with the image features at the image_token_id positions (in row-major order of those
        positions: transformers' masked_scatter), in the decoder's layout [S, B, H] (a sequence-parallel slice
        under SP)."""
        mask = input_ids == self.image_token_id
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(f"{int(mask.sum())} image placeholder tokens (id {self.image_token_id}) but the images "
                             f"give {features.shape[0]} features")
        hidden = words.masked_scatter(mask.unsqueeze(-1), features.to(words.dtype)).transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden)
        return hidden

    def block_inputs(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                     image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The decoder's input, image features in place, and what else the decoder block takes (none here)."""
        return self.place_images(input_ids, self.words(input_ids), self.visual(pixel_values, image_grid_thw)), {}

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None, **kwargs):
        if decoder_input is None and self.pre_process and pixel_values is not None and len(image_grid_thw):
            try:
                decoder_input, block_kwargs = self.block_inputs(input_ids, pixel_values, image_grid_thw)
            except ValueError as e:
                raise ValueError(f"{e} (image_grid_thw {image_grid_thw.tolist()})") from None
            if block_kwargs:
                kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), **block_kwargs}
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)


class Qwen2VL(DecoderFamily):
    name = "Qwen2.5-VL"
    architectures = ARCHITECTURES
    qkv_bias = True
    model_class = Qwen2VLModel

    def check_supported(self, hf: dict) -> None:
        super().check_supported(text_config(hf))

    def rope_kwargs(self, hf: dict) -> dict:
        params = rope_parameters(text_config(hf))
        if params["rope_type"] not in ("default", "mrope"):
            raise ValueError(f"{self.name} with RoPE scaling {params['rope_type']!r} is not supported")
        return dict(rotary_base=float(params["rope_theta"]))

    def transformer_config(self, hf: dict, tp: int, pp: int, params_dtype: torch.dtype,
                           use_cpu_initialization: bool, **layout):
        config = super().transformer_config(text_config(hf), tp, pp, params_dtype, use_cpu_initialization, **layout)
        return dataclasses.replace(config, mrope_section=mrope_section(hf))

    def gpt_model_kwargs(self, hf: dict, tp: int) -> dict:
        text = text_config(hf)
        return super().gpt_model_kwargs(text, tp) | dict(
            position_embedding_type="mrope", vision=hf["vision_config"], image_token_id=hf["image_token_id"])

    def with_model_inputs(self, hf: dict, batch: Batch) -> Batch:
        """The batch with `mrope_position_ids` [B, 3, T] (0 on padding) from its tokens and each row's
        image_grid_thw (a text-only batch, or row, counts up on all three axes), and its loss_mask cleared at the
        image placeholder tokens (image features are inputs, never targets)."""
        if "mrope_position_ids" in batch:
            return batch
        tokens = batch["tokens"]
        tensors = dict(batch.tensors)
        if "loss_mask" in tensors:
            tensors["loss_mask"] = tensors["loss_mask"] * (tokens != hf["image_token_id"])
        # tokens up to the last real one (right padding)
        lengths = (torch.arange(1, tokens.shape[1] + 1) * (batch["attention_mask"].cpu() > 0)).max(1).values.tolist()
        grids = batch["image_grid_thw"] if "image_grid_thw" in batch else [None] * len(tokens)
        positions = torch.zeros(len(tokens), 3, tokens.shape[1], dtype=torch.long)
        merge = hf["vision_config"]["spatial_merge_size"]
        for i, (n, grid) in enumerate(zip(lengths, grids)):
            grid = torch.zeros(0, 3, dtype=torch.long) if grid is None else grid
            try:
                positions[i, :, :n] = mrope_positions(tokens[i, :n], grid, hf["image_token_id"], merge)
            except ValueError as e:
                raise ValueError(f"batch row {i}: {e}") from None
        return Batch({**tensors, "mrope_position_ids": positions}, dict(batch.non_tensors), dict(batch.meta))

    def weight_maps(self, hf: dict, tp: int) -> list[WeightMap]:
        vision = [WeightMap(f"visual.{n}", (f"visual.{n}",), **replicated())
                  for n in vision_parameter_names(hf["vision_config"])]
        return vision + super().weight_maps(text_config(hf), tp)


FAMILY = Qwen2VL()


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int,
                    merge_size: int) -> torch.Tensor:
    """[3, T] M-RoPE position ids of one sequence (no padding): text tokens count up on all three axes; each image
    (a run of its t*h*w/merge^2 placeholder tokens, images in order) starts at the next position p and puts its
    merge group at (p + frame, p + row, p + column); the text after it continues from p + max(h, w)/merge."""
    ids = input_ids.tolist()
    grids = [tuple(g) for g in image_grid_thw.tolist()]
    out, pos, i, image = [], 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(torch.full((3, 1), pos))
            pos, i = pos + 1, i + 1
            continue
        if image >= len(grids):
            raise ValueError(f"more image placeholder runs than images ({len(grids)} grids)")
        t, h, w = grids[image]
        h, w = h // merge_size, w // merge_size
        if ids[i:i + t * h * w].count(image_token_id) != t * h * w:
            raise ValueError(f"image {image} (grid {list(grids[image])}) needs {t * h * w} placeholder tokens at "
                             f"position {i}; the sequence has {ids[i:i + t * h * w].count(image_token_id)}")
        frames, rows, cols = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out.append(torch.stack([frames, rows, cols]).reshape(3, -1) + pos)
        pos, i, image = pos + max(h, w), i + t * h * w, image + 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} images but {image} runs of image placeholder tokens")
    return torch.cat(out, 1) if out else torch.zeros(3, 0, dtype=torch.long)
