"""What a published HF checkpoint holds beyond the weights megarl trains, on the way in and on the way out.

- Block-wise FP8 weights (DeepSeek-V3's release format, also Qwen3's *-FP8): a float8_e4m3fn `<name>` and a
  float32 `<name>_scale_inv` of one inverse scale per weight_block_size block (the blocks at the right and
  bottom edges may be partial). They are read dequantized: weight * scale_inv in float32, then cast to the
  parameters' dtype by whoever stores them. Any other quantization_config is refused by key.
- MXFP4 weights (gpt-oss's release format, quant_method 'mxfp4'): `<name>_blocks` uint8 [..., out, G, 16], two
  FP4 (E2M1) values a byte, the low nibble first, and `<name>_scales` uint8 [..., out, G], one power of two
  2^(scale - 127) per block of 32 values; they stand for `<name>`, input-major [..., G x 32, out] as transformers'
  GptOssExperts holds it, read dequantized in float32 (MXFP4.dequantize; exact: every value is a FP4 value times a
  power of two). Rows of a tensor that stacks a layer's experts are read one at a time (`read(name, row)`).
- Multi-token-prediction layers (`num_nextn_predict_layers`, tensors `model.layers.{num_hidden_layers + i}.*`):
  megarl does not train them. Import leaves them out (one logged line); every megarl checkpoint keeps the
  source's own copy of them (MTP_FILE in its hf/ directory, bytes as read) and export writes it back.
- A multimodal checkpoint trained as a text-only policy (Gemma 3's, Qwen3.5's: hf_config.TEXT_ONLY_TOWERS): its
  vision tower and projector are left out on import (one logged line, which says images are not used in training),
  kept in every megarl checkpoint (TOWER_FILE, bytes as read) and written back by export, as the MTP layers are.
  Tensors stored under transformers' in-memory names (model.language_model.* ...) are read, kept and written back
  under its on-disk ones (IN_MEMORY_PREFIXES).
- Qwen3.5-MoE's routed experts stacked per layer (its releases' format), listed and read as one tensor per expert and
  projection, the names megarl's weight maps use and its exports write (PER_EXPERT_READ).
- config.json fields that SGLang's DeepSeek model reads and transformers' DeepseekV3Config / DeepseekV2Config do
  not write (SGLang 0.5.17 fails to start without moe_layer_freq): added to every config.json megarl writes.
- DeepSeek-V3's routing bias (e_score_correction_bias), which transformers and SGLang keep in float32 whatever
  the model's dtype: written in float32 whatever dtype the rest is written in (written_dtype).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.utils.hf_config import TEXT_ONLY_TOWERS

logger = logging.getLogger(__name__)

QUANTIZATION_KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"
MTP_FILE = "mtp.safetensors"  # in a megarl checkpoint's <role>/hf/: the source's multi-token-prediction tensors
TOWER_FILE = "vision.safetensors"  # beside it: the source's vision tower of a text-only policy
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_FLOAT32_TENSORS = re.compile(r"\.mlp\.gate\.e_score_correction_bias$")  # MTP layers' too
_SUPPORTED_FP8 = "block-wise FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size [rows, cols], " \
                 "activation_scheme 'dynamic') or MXFP4 (quant_method 'mxfp4')"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# The FP4 (E2M1) value of each 4-bit code: sign bit, then two exponent bits and one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

SWIGLU_LIMIT = 7.0  # gpt-oss's: transformers' GptOssExperts.limit (its alpha, 1.702, is megatron's quick_gelu)
# Published config.json fields SGLang reads, with the values that transformers' own model of each model_type
# implies; a value the config already has is never replaced. gpt-oss's swiglu_limit: SGLang's GptOssForCausalLM
# reads it, transformers' config writer drops it.
SGLANG_FIELDS = {
    "deepseek_v3": {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1,
                    "num_nextn_predict_layers": 0},
    "deepseek_v2": {"moe_layer_freq": 1, "topk_method": "greedy", "scoring_func": "softmax", "ep_size": 1,
                    "num_nextn_predict_layers": 0},
    "gpt_oss": {"swiglu_limit": SWIGLU_LIMIT},
}


class SafetensorsCheckpoint:
    """Lazy, by-name access to the tensors of a HF model directory (one or several .safetensors) as the model
    uses them: FP8 weights dequantized (their scales are not listed), multi-token-prediction layers left out,
    Qwen3.5-MoE's stacked experts listed per expert (PER_EXPERT_READ)."""

    def __init__(self, model_dir: str | Path):
        config_path = Path(model_dir) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.fp8 = BlockFP8.from_config(config, str(config_path))
        mxfp4 = (config.get(QUANTIZATION_KEY) or {}).get("quant_method") == "mxfp4"
        self._all_files, shapes = _index(sorted(Path(model_dir).glob("*.safetensors")), str(model_dir))
        # MXFP4 pairs by the name they stand for (an unquantized checkpoint may not have any *_blocks tensor)
        self.mxfp4 = {n.removesuffix(MXFP4_BLOCKS): MXFP4.shape(shapes[n]) for n in shapes
                      if mxfp4 and n.endswith(MXFP4_BLOCKS) and n.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES in shapes}
        packed = {n + suffix for n in self.mxfp4 for suffix in (MXFP4_BLOCKS, MXFP4_SCALES)}
        mtp = [n for n in shapes if not is_scale(n) and is_mtp(n, config)]
        log_dropped_mtp(mtp, config, model_dir)
        tower = [n for n in shapes if is_kept_tower(on_disk_name(n, config), config)]
        log_kept_tower([on_disk_name(n, config) for n in tower], config, model_dir)
        left_out = set(mtp) | set(tower) | packed
        # stacked experts, listed as one tensor per expert and projection: name -> (stored name, expert, half)
        self.expert_rows, expert_shapes = per_expert_views({n: s for n, s in shapes.items() if n not in left_out},
                                                           config)
        left_out |= {stored for stored, _, _ in self.expert_rows.values()}
        shapes = {n: s for n, s in shapes.items() if not is_scale(n) and n not in left_out} | self.mxfp4 | expert_shapes
        # listed by transformers' on-disk names (IN_MEMORY_PREFIXES), read by the names the files store
        self._stored = {on_disk_name(n, config): n for n in shapes}
        self.shapes: dict[str, tuple[int, ...]] = {on_disk_name(n, config): s for n, s in shapes.items()}
        self.files: dict[str, Path] = {name: self._all_files[self._file_key(n)] for name, n in self._stored.items()}

    def _file_key(self, stored: str) -> str:
        """The name, in the files, of the tensor that holds `stored`."""
        if stored in self.expert_rows:
            return self.expert_rows[stored][0]
        return stored + MXFP4_BLOCKS if stored in self.mxfp4 else stored

    def read(self, name: str, row: int | None = None) -> torch.Tensor:
        """The tensor (or its row `row` along dim 0) in its stored dtype, or float32 for an FP8 or MXFP4 weight (its
        dequantized values)."""
        if name not in self.files:
            raise KeyError(f"tensor '{name}' is not in the checkpoint ({len(self.files)} tensors)")
        stored = self._stored[name]
        if stored in self.expert_rows:
            if row is not None:
                raise ValueError(f"{name} is one expert's row of {self.expert_rows[stored][0]}: read it whole")
            stacked, expert, half = self.expert_rows[stored]
            tensor = read_dequantized(self._all_files, stacked, self.fp8, expert)
            return tensor if half is None else tensor.chunk(2, 0)[half]
        if stored in self.mxfp4:
            return MXFP4.dequantize(read_tensor(self._all_files, stored + MXFP4_BLOCKS, row),
                                    read_tensor(self._all_files, stored + MXFP4_SCALES, row), stored)
        return read_dequantized(self._all_files, stored, self.fp8, row)


# Qwen3.5-MoE's published checkpoints stack each layer's routed experts output-major, as transformers holds them in
# memory: experts.gate_up_proj [E, 2 x width, hidden] (an expert's gate rows, then its up rows) and experts.down_proj
# [E, hidden, width]; transformers' save_pretrained writes one tensor per expert and projection, which megarl's
# weight maps name and export writes (SGLang and transformers load either)
PER_EXPERT_READ = ("qwen3_5_moe", "qwen3_5_moe_text")
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def per_expert_views(shapes: dict[str, tuple[int, ...]], config: dict) -> tuple[dict, dict]:
    """For a PER_EXPERT_READ model type, each stacked experts tensor among `shapes` (stored names) as the
    per-expert tensors it holds: ({per-expert name: (stored name, expert, half: 0 gate, 1 up, None down)},
    {per-expert name: shape}); none for another model type."""
    if config.get("model_type") not in PER_EXPERT_READ:
        return {}, {}
    rows, row_shapes = {}, {}
    for name, shape in shapes.items():
        match = _STACKED_EXPERTS.match(name)
        if not match:
            continue
        prefix, kind = match.groups()
        parts = ((0, "gate_proj", (shape[1] // 2, shape[2])), (1, "up_proj", (shape[1] // 2, shape[2]))) \
            if kind == "gate_up_proj" else ((None, "down_proj", tuple(shape[1:])),)
        for expert in range(shape[0]):
            for half, projection, row_shape in parts:
                rows[f"{prefix}{expert}.{projection}.weight"] = (name, expert, half)
                row_shapes[f"{prefix}{expert}.{projection}.weight"] = row_shape
    return rows, row_shapes


def _index(paths: list[Path], where: str) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """The tensors of some safetensors files: name -> file, name -> shape (headers only)."""
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {where}")
    files, shapes = {}, {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                files[name] = path
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return files, shapes


def read_tensor(files: dict[str, Path], name: str, row: int | None = None) -> torch.Tensor:
    """The tensor, or only its row `row` along dim 0."""
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name) if row is None else f.get_slice(name)[row]


# -------------------------------------------------------------------------------------------------
# Block-wise FP8


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's block-wise FP8 format: weight_block_size (rows, cols) of one inverse scale each."""
    block: tuple[int, int]

    @classmethod
    def from_config(cls, config: dict, where: str) -> BlockFP8 | None:
        """None for an unquantized checkpoint or an MXFP4 one (MXFP4 reads those); `where` (the config.json path)
        names the file in errors."""
        quant = config.get(QUANTIZATION_KEY)
        if quant is None or quant.get("quant_method") == "mxfp4":
            return None
        quant = {"fmt": "e4m3", **quant}  # fmt may be left out: e4m3 is what fp8 means then
        for key, value in {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}.items():
            if quant.get(key) != value:
                raise ValueError(f"{where}: {QUANTIZATION_KEY}.{key}={quant.get(key)!r} is not supported; megarl "
                                 f"reads unquantized checkpoints and {_SUPPORTED_FP8}")
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: {QUANTIZATION_KEY}.weight_block_size={block!r} is not supported; megarl "
                             f"reads {_SUPPORTED_FP8}")
        return cls(tuple(block))

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
        """weight * its block's scale_inv, in float32."""
        rows, cols = self.block
        if weight.dim() != 2:
            raise ValueError(f"{name}: a block-wise FP8 weight must be 2-D, it has shape {tuple(weight.shape)}")
        blocks = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
        if tuple(scale_inv.shape) != blocks:
            raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; weight {tuple(weight.shape)} "
                             f"in blocks of {list(self.block)} needs {blocks}")
        scale = scale_inv.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)  # edge blocks: cut below
        return weight.float() * scale[:weight.shape[0], :weight.shape[1]]


def read_dequantized(files: dict[str, Path], name: str, fp8: BlockFP8 | None, row: int | None = None) -> torch.Tensor:
    """A tensor (or its row `row`) as the model uses it: an FP8 weight multiplied out by its inverse scales (float32)."""
    tensor = read_tensor(files, name, row)
    if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor
    if row is not None:
        raise ValueError(f"{name} in {files[name]} is FP8: its block scales are read whole, not by row")
    if fp8 is None:
        raise ValueError(f"{name} in {files[name]} is {tensor.dtype} but the checkpoint's config.json has no "
                         f"{QUANTIZATION_KEY}; megarl reads {_SUPPORTED_FP8}")
    if tensor.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} in {files[name]} is {tensor.dtype}; {QUANTIZATION_KEY} says e4m3")
    if name + SCALE_SUFFIX not in files:
        raise ValueError(f"{name} in {files[name]} is FP8 without its inverse scales {name}{SCALE_SUFFIX}")
    return fp8.dequantize(tensor, read_tensor(files, name + SCALE_SUFFIX), name)


class MXFP4:
    """The MXFP4 format (module docstring): `<name>_blocks` and `<name>_scales` -> `<name>`."""

    @staticmethod
    def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the tensor a *_blocks tensor of this shape stands for."""
        *rows, out, groups, group_bytes = blocks_shape
        return (*rows, groups * group_bytes * 2, out)

    @staticmethod
    def dequantize(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
        """blocks uint8 [..., out, G, 16], scales uint8 [..., out, G] -> float32 [..., G x 32, out]."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
            raise ValueError(f"{name}: MXFP4 needs uint8 {name}{MXFP4_BLOCKS} [..., out, G, 16] and {name}"
                             f"{MXFP4_SCALES} [..., out, G]; they are {blocks.dtype} {tuple(blocks.shape)} and "
                             f"{scales.dtype} {tuple(scales.shape)}")
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # the low nibble is the earlier value
        values = torch.tensor(FP4_VALUES, dtype=torch.float32)[codes].reshape(*scales.shape, -1)
        values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
        return values.reshape(*scales.shape[:-1], -1).transpose(-1, -2).contiguous()


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


# -------------------------------------------------------------------------------------------------
# Multi-token-prediction layers


def mtp_layers(config: dict) -> range:
    """The layer indices of the multi-token-prediction layers (after the num_hidden_layers trained ones)."""
    first = config.get("num_hidden_layers", 0)
    return range(first, first + (config.get("num_nextn_predict_layers") or 0))


def is_mtp(name: str, config: dict) -> bool:
    match = _LAYER_INDEX.match(name)
    return match is not None and int(match.group(1)) in mtp_layers(config)


def log_dropped_mtp(names: list[str], config: dict, model_dir: str | Path) -> None:
    """The one line import logs for the MTP tensors it leaves out (on rank 0 of a job)."""
    if not names or (dist.is_initialized() and dist.get_rank() != 0):
        return
    layers = mtp_layers(config)
    prefixes = ", ".join(f"model.layers.{i}.*" for i in layers)
    logger.warning("%s: not loading the %d tensors of the %d multi-token-prediction layer(s) %s "
                   "(num_nextn_predict_layers=%d): megarl does not train them; its checkpoints keep this copy "
                   "and export writes it back", model_dir, len(names), len(layers), prefixes, len(layers))


# -------------------------------------------------------------------------------------------------
# A multimodal checkpoint's vision tower, kept untrained (text-only RL: megarl.utils.hf_config.TEXT_ONLY_TOWERS)


def is_kept_tower(name: str, config: dict) -> bool:
    """Whether `name` (transformers' on-disk spelling: on_disk_name) is a text-only policy's vision tower's."""
    return name.startswith(TEXT_ONLY_TOWERS.get(config.get("model_type"), ()))


# transformers' in-memory module names, which some re-saved checkpoints carry (saved from a state dict, not by
# save_pretrained), by model type: (that prefix, transformers' on-disk prefix, which megarl reads and writes them
# under: the published checkpoints', save_pretrained's and SGLang's loader's)
IN_MEMORY_PREFIXES = {"gemma3": (("model.language_model.", "language_model.model."),
                                 ("model.vision_tower.", "vision_tower."),
                                 ("model.multi_modal_projector.", "multi_modal_projector."))}


def on_disk_name(name: str, config: dict) -> str:
    for stored, on_disk in IN_MEMORY_PREFIXES.get(config.get("model_type"), ()):
        if name.startswith(stored):
            return on_disk + name[len(stored):]
    return name


def log_kept_tower(names: list[str], config: dict, model_dir: str | Path) -> None:
    """The one line import logs for the vision tower it leaves out (on rank 0 of a job)."""
    if not names or (dist.is_initialized() and dist.get_rank() != 0):
        return
    prefixes = sorted({p for p in TEXT_ONLY_TOWERS[config["model_type"]] if any(n.startswith(p) for n in names)})
    logger.warning("%s: %s trained as a text-only policy: images are not used in training; not loading the %d tensors "
                   "of its vision tower and projector (%s), which megarl's checkpoints keep as they are and export "
                   "writes back", model_dir, (config.get("architectures") or [config["model_type"]])[0], len(names),
                   ", ".join(p + "*" for p in prefixes))


# -------------------------------------------------------------------------------------------------
# What megarl keeps untrained: copied into every checkpoint, written back by export


UNTRAINED_FILES = ((MTP_FILE, is_mtp), (TOWER_FILE, is_kept_tower))


def save_untrained_copies(model_dir: str | Path, out_dir: str | Path) -> int:
    """Copy the tensors of a HF model directory that megarl does not train (MTP layers with their FP8 scales, a
    text-only policy's vision tower, under transformers' on-disk names; bytes as stored) into out_dir, each kind into
    its UNTRAINED_FILES file; returns
    how many tensors (0: none, nothing written). model_dir may be a megarl checkpoint's hf/ directory, whose copies
    are copied on."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    paths = sorted(Path(model_dir).glob("*.safetensors"))
    if not paths or not (mtp_layers(config) or config.get("model_type") in TEXT_ONLY_TOWERS):
        return 0
    files, _ = _index(paths, str(model_dir))
    count = 0
    for file, kept in UNTRAINED_FILES:
        names = [n for n in files if kept(on_disk_name(n, config), config)]
        if names:
            save_file({on_disk_name(n, config): read_tensor(files, n) for n in names}, str(Path(out_dir) / file),
                      metadata={"format": "pt"})
        count += len(names)
    return count


def iter_untrained_copies(hf_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The untrained tensors a megarl checkpoint's hf/ directory keeps, one at a time, dequantized as its
    config.json says (float32 where they are FP8); none when it keeps none."""
    config_path = Path(hf_dir) / "config.json"
    for file, _ in UNTRAINED_FILES:
        path = Path(hf_dir) / file
        if not path.exists():
            continue
        fp8 = BlockFP8.from_config(json.loads(config_path.read_text()), str(config_path))
        files, _ = _index([path], str(hf_dir))
        for name in files:
            if not is_scale(name):
                yield name, read_dequantized(files, name, fp8)


def written_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` is written in when megarl writes weights in `dtype`: float32 for DeepSeek-V3's routing
    bias (transformers keeps it in float32 in any model dtype, SGLang too), else `dtype`."""
    return torch.float32 if _FLOAT32_TENSORS.search(name) else dtype


# -------------------------------------------------------------------------------------------------
# config.json


def export_config(config: dict, dtype: torch.dtype) -> dict:
    """The config.json of weights megarl writes in `dtype`: no quantization_config (the weights are not
    quantized), the dtype, and for DeepSeek and gpt-oss the fields SGLang reads (existing values kept)."""
    config = {k: v for k, v in config.items() if k != QUANTIZATION_KEY}
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return with_sglang_fields(config)


def value_model_config(config: dict) -> dict:
    """The config.json of a model with megarl's value head (a critic or reward model: `score.weight`, one output):
    transformers' *ForSequenceClassification of the family with one label, which reads `score` at the last
    token that is not padding (pad_token_id), as megarl reads a reward model's score at the last token."""
    architectures = [name.replace("ForCausalLM", "ForSequenceClassification")
                     for name in config.get("architectures") or []]
    return config | {"architectures": architectures, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def with_sglang_fields(config: dict) -> dict:
    """A DeepSeek or gpt-oss config.json with the published fields SGLang reads (SGLANG_FIELDS) that it lacks;
    other model types unchanged."""
    return {**SGLANG_FIELDS.get(config.get("model_type"), {}), **config}
