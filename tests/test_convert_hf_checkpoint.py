"""Published-checkpoint formats on import and export (megarl/models/hf_checkpoint.py): block-wise FP8 weights
read as their exact dequantized values, other quantization refused by key, multi-token-prediction layers left out
of the model and written back on export, the DeepSeek config fields SGLang reads."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.convert import main
from megarl.models.hf_checkpoint import MTP_FILE, BlockFP8, SafetensorsCheckpoint, export_config, save_mtp_copy

FP8_MAX = 448.0  # the largest float8_e4m3fn


def fp8_config(block=(16, 24)) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block), "activation_scheme": "dynamic"}


def quantize(weight: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as DeepSeek publishes it: per block, scale = amax / 448; stored weight / scale in e4m3
    and scale as <name>_scale_inv."""
    rows, cols = block
    blocks = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(blocks, dtype=torch.float32)
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            part = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float()
            scale_inv[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (part / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_reference(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """The dequantized weight, block by block (independent of megarl's broadcast)."""
    rows, cols = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (
                q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float() * scale_inv[i, j])
    return out


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek-V3 ships in FP8: the 2-D projection weights (not embeddings, head, norms, router)."""
    return name.endswith("proj.weight") and tensor.dim() == 2


def write_fp8_copy(src: str | Path, fp8_dir: Path, dequantized_dir: Path, block=(16, 24)) -> None:
    """fp8_dir: src with its projections block-wise FP8 (config: quantization_config). dequantized_dir: the same
    model with those weights dequantized to float32 by dequantize_reference (config unchanged)."""
    for out in (fp8_dir, dequantized_dir):
        shutil.copytree(src, out)
    tensors = load_file(f"{src}/model.safetensors")
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, scale_inv = quantize(t, block)
            fp8 |= {name: q, name + "_scale_inv": scale_inv}
            dequantized[name] = dequantize_reference(q, scale_inv, block)
        else:
            fp8[name] = dequantized[name] = t
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = fp8_config(block)
    (fp8_dir / "config.json").write_text(json.dumps(config))


def write_tensors(directory: Path, tensors: dict, config: dict) -> None:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))


def test_fp8_weights_read_as_their_blockwise_dequantized_values(tmp_path):
    block = (16, 24)
    torch.manual_seed(0)
    # 37 x 50: partial edge blocks in both dimensions; 32 x 48: whole blocks only
    weights = {"a.proj.weight": torch.randn(37, 50) * 3, "b.proj.weight": torch.randn(32, 48), "norm.weight": torch.rand(8)}
    stored = {"norm.weight": weights["norm.weight"]}
    for name in ("a.proj.weight", "b.proj.weight"):
        q, scale_inv = quantize(weights[name], block)
        stored |= {name: q, name + "_scale_inv": scale_inv}
    write_tensors(tmp_path / "fp8", stored, {"num_hidden_layers": 1, "quantization_config": fp8_config(block)})

    checkpoint = SafetensorsCheckpoint(tmp_path / "fp8")
    assert checkpoint.shapes == {"a.proj.weight": (37, 50), "b.proj.weight": (32, 48), "norm.weight": (8,)}
    for name in ("a.proj.weight", "b.proj.weight"):
        read = checkpoint.read(name)
        assert read.dtype == torch.float32
        assert torch.equal(read, dequantize_reference(stored[name], stored[name + "_scale_inv"], block))
        assert (read - weights[name]).abs().max() < 0.07 * weights[name].abs().max()  # FP8: ~2^-4 relative
    assert torch.equal(checkpoint.read("norm.weight"), weights["norm.weight"])
    with pytest.raises(KeyError):
        checkpoint.read("a.proj.weight_scale_inv")

    # Bad FP8 tensors fail by name: scales of the wrong shape, no scales, FP8 without a quantization_config.
    bad_scales = dict(stored, **{"a.proj.weight_scale_inv": torch.ones(2, 2)})
    write_tensors(tmp_path / "bad_scales", bad_scales, {"quantization_config": fp8_config(block)})
    with pytest.raises(ValueError, match=r"a\.proj\.weight_scale_inv has shape \(2, 2\).*needs \(3, 3\)"):
        SafetensorsCheckpoint(tmp_path / "bad_scales").read("a.proj.weight")
    write_tensors(tmp_path / "no_scales", {"a.proj.weight": stored["a.proj.weight"]},
                  {"quantization_config": fp8_config(block)})
    with pytest.raises(ValueError, match="without its inverse scales a.proj.weight_scale_inv"):
        SafetensorsCheckpoint(tmp_path / "no_scales").read("a.proj.weight")
    write_tensors(tmp_path / "no_config", stored, {})
    with pytest.raises(ValueError, match="float8_e4m3fn but the checkpoint's config.json has no quantization_config"):
        SafetensorsCheckpoint(tmp_path / "no_config").read("a.proj.weight")


@pytest.mark.parametrize("key, value", [("quant_method", "awq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                        ("weight_block_size", None), ("weight_block_size", [128])])
def test_other_quantization_configs_are_refused_by_key_and_file(tmp_path, capsys, key, value):
    from tests.engine.hf_models import make_qwen2_dir

    hf = Path(make_qwen2_dir(tmp_path / "hf", tied=False))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {**fp8_config(), key: value}
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{hf / 'config.json'}: quantization_config\.{key}="):
        SafetensorsCheckpoint(hf)
    assert main(["hf-to-megatron", str(hf), str(tmp_path / "out")]) == 2
    assert f"{hf / 'config.json'}: quantization_config.{key}={value!r} is not supported" in capsys.readouterr().err


def test_mtp_layers_are_left_out_and_copied_as_stored(tmp_path, caplog):
    """Layers num_hidden_layers .. + num_nextn_predict_layers - 1 are not the model's: not listed, logged once;
    save_mtp_copy keeps their bytes (FP8 scales included)."""
    block = (16, 24)
    q, scale_inv = quantize(torch.randn(32, 64), block)
    tensors = {"model.layers.0.mlp.down_proj.weight": torch.randn(32, 48), "model.norm.weight": torch.ones(32),
               "model.layers.1.eh_proj.weight": q, "model.layers.1.eh_proj.weight_scale_inv": scale_inv,
               "model.layers.1.enorm.weight": torch.rand(32), "model.layers.1.shared_head.head.weight": torch.randn(5, 32)}
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "num_nextn_predict_layers": 1,
              "quantization_config": fp8_config(block)}
    write_tensors(tmp_path / "hf", tensors, config)
    with caplog.at_level(logging.WARNING, logger="megarl.models.hf_checkpoint"):
        checkpoint = SafetensorsCheckpoint(tmp_path / "hf")
    assert set(checkpoint.shapes) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}
    assert len(caplog.records) == 1
    assert "the 3 tensors of the 1 multi-token-prediction layer(s) model.layers.1.*" in caplog.records[0].getMessage()

    (tmp_path / "kept").mkdir()
    assert save_mtp_copy(tmp_path / "hf", tmp_path / "kept") == 4
    kept = load_file(str(tmp_path / "kept" / MTP_FILE))
    mtp = {n: t for n, t in tensors.items() if n.startswith("model.layers.1.")}
    assert kept.keys() == mtp.keys()
    assert all(kept[n].dtype == t.dtype and torch.equal(kept[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in mtp.items())
    # Without num_nextn_predict_layers the layer after the last is nothing special: nothing copied.
    write_tensors(tmp_path / "plain", tensors, {**config, "num_nextn_predict_layers": 0})
    (tmp_path / "none").mkdir()
    assert save_mtp_copy(tmp_path / "plain", tmp_path / "none") == 0 and not any((tmp_path / "none").iterdir())
