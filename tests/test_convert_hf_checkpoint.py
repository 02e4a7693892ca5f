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
from megarl.models.hf_checkpoint import MTP_FILE, SafetensorsCheckpoint, export_config, iter_untrained_copies, save_untrained_copies
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch
from tests.test_convert import convert

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
    weights = {"a.proj.weight": torch.randn(37, 50) * 3, "b.proj.weight": torch.randn(32, 48),
               "norm.weight": torch.rand(8)}
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
    save_untrained_copies keeps their bytes (FP8 scales included)."""
    block = (16, 24)
    q, scale_inv = quantize(torch.randn(32, 64), block)
    tensors = {"model.layers.0.mlp.down_proj.weight": torch.randn(32, 48), "model.norm.weight": torch.ones(32),
               "model.layers.1.eh_proj.weight": q, "model.layers.1.eh_proj.weight_scale_inv": scale_inv,
               "model.layers.1.enorm.weight": torch.rand(32),
               "model.layers.1.shared_head.head.weight": torch.randn(5, 32)}
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 1, "num_nextn_predict_layers": 1,
              "quantization_config": fp8_config(block)}
    write_tensors(tmp_path / "hf", tensors, config)
    with caplog.at_level(logging.WARNING, logger="megarl.models.hf_checkpoint"):
        checkpoint = SafetensorsCheckpoint(tmp_path / "hf")
    assert set(checkpoint.shapes) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}
    assert len(caplog.records) == 1
    assert "the 3 tensors of the 1 multi-token-prediction layer(s) model.layers.1.*" in caplog.records[0].getMessage()

    (tmp_path / "kept").mkdir()
    assert save_untrained_copies(tmp_path / "hf", tmp_path / "kept") == 4
    kept = load_file(str(tmp_path / "kept" / MTP_FILE))
    mtp = {n: t for n, t in tensors.items() if n.startswith("model.layers.1.")}
    assert kept.keys() == mtp.keys()
    assert all(kept[n].dtype == t.dtype and torch.equal(kept[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in mtp.items())
    # Export reads the kept copy dequantized, as the checkpoint's config.json says; its config has no quantization.
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "kept")
    written = dict(iter_untrained_copies(tmp_path / "kept"))
    assert written.keys() == {n for n in mtp if not n.endswith("_scale_inv")}
    assert torch.equal(written["model.layers.1.eh_proj.weight"], dequantize_reference(q, scale_inv, block))
    assert torch.equal(written["model.layers.1.enorm.weight"], tensors["model.layers.1.enorm.weight"])
    exported = export_config(config, torch.bfloat16)
    assert "quantization_config" not in exported and exported["dtype"] == "bfloat16"
    assert exported["num_nextn_predict_layers"] == 1 and exported["scoring_func"] == "sigmoid"

    # Without num_nextn_predict_layers the layer after the last is nothing special: nothing copied.
    write_tensors(tmp_path / "plain", tensors, {**config, "num_nextn_predict_layers": 0})
    (tmp_path / "none").mkdir()
    assert save_untrained_copies(tmp_path / "plain", tmp_path / "none") == 0 and not any((tmp_path / "none").iterdir())


# -------------------------------------------------------------------------------------------------
# Tiny DeepSeek models: layer 0 dense, layer 1 MoE (8 routed experts, a shared one), DeepSeek-V3 with one MTP layer.


def add_mtp_layer(model_dir: str | Path, seed: int = 5) -> list[str]:
    """Give a DeepSeek-V3 directory (num_nextn_predict_layers=1) the MTP layer the published checkpoint has:
    model.layers.{num_hidden_layers}.* = a decoder layer like the last one plus enorm, hnorm, eh_proj,
    shared_head.{norm, head} and embed_tokens, all random. Returns their names."""
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    shapes = {n.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): t.shape
              for n, t in tensors.items() if n.startswith(f"model.layers.{last}.")}
    shapes |= {f"model.layers.{mtp}.{n}": s for n, s in
               {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
                "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (vocab, hidden),
                "embed_tokens.weight": (vocab, hidden)}.items()}
    added = {n: 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}
    save_file(tensors | added, str(path), metadata={"format": "pt"})
    return sorted(added)


def deepseek_dir(path: Path, version: str) -> str:
    from tests.models.hf_families import deepseek_v2_config, deepseek_v3_config, save_random

    if version == "v3":
        hf = save_random(deepseek_v3_config(layers=2, first_k_dense_replace=1, num_nextn_predict_layers=1), path)
        add_mtp_layer(hf)
        return hf
    return save_random(deepseek_v2_config(layers=2, first_k_dense_replace=1), path)


def _logprobs_rank(rank, runs: list[tuple[str, str]]):
    """The log-probs of each (model directory, precision)."""
    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.engine import MegatronEngine

    out = []
    for model_dir, precision in runs:
        engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=4, precision=precision), AlgorithmConfig(),
                                "cpu", 1, 10)
        out.append(engine.compute_logprobs(padded_batch(rows=4))["logprobs"])
    return out


def test_deepseek_fp8_checkpoint_gives_the_logprobs_of_its_dequantized_copy(tmp_path):
    """DeepSeek-V3 (MoE, MTP layer) with every projection in block-wise FP8, loaded at TP=2: the log-probs equal
    those of the same model stored dequantized, in fp32 and (stored rounded to bf16 once) in bf16."""
    source = deepseek_dir(tmp_path / "hf", "v3")
    write_fp8_copy(source, tmp_path / "fp8", tmp_path / "dequantized")
    shutil.copytree(tmp_path / "dequantized", tmp_path / "dequantized_bf16")
    bf16 = {n: t.to(torch.bfloat16) for n, t in load_file(f"{tmp_path}/dequantized/model.safetensors").items()}
    save_file(bf16, str(tmp_path / "dequantized_bf16" / "model.safetensors"))

    fp8, dequantized, original, fp8_bf16, dequantized_bf16 = run_distributed(_logprobs_rank, 2, [
        (str(tmp_path / "fp8"), "fp32"), (str(tmp_path / "dequantized"), "fp32"), (source, "fp32"),
        (str(tmp_path / "fp8"), "bf16"), (str(tmp_path / "dequantized_bf16"), "bf16")], tp=2)
    assert torch.equal(fp8, dequantized)
    assert torch.equal(fp8_bf16, dequantized_bf16)
    assert (fp8 - original).abs().max() > 1e-3  # the FP8 copy really is quantized: not the original's log-probs


def _export_at_layout_rank(rank, source: str, imported: str, root: str, tp: int, pp: int, ep: int):
    """The imported checkpoint loaded at TP x PP x EP (into an engine of the source's shapes whose weights are
    zeroed first): its HF tensors as export yields them; saved again there."""
    from megatron.core import parallel_state

    from megarl.config import ActorConfig, AlgorithmConfig
    from megarl.engine import MegatronEngine
    from megarl.parallel.state import build_model_parallel
    from tests.engine.test_checkpoint import save

    if ep > 1:
        parallel_state.destroy_model_parallel()
        build_model_parallel(tp, pp, seed=1, ep=ep)
    engine = MegatronEngine(source, ActorConfig(), AlgorithmConfig(), "cpu", 1, 10)
    with torch.no_grad():
        for gpt in engine.gpts:
            for p in gpt.parameters():
                p.zero_()
    engine.load_checkpoint(f"{imported}/actor")
    exported = {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    save(engine, Path(root), 1)
    return exported


def read_all(model_dir: Path) -> dict:
    return {n: t for path in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(str(path)).items()}


def assert_bitwise_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


# V3 only (through EP=2, an MTP layer in the source): V2's HF <-> megatron weights are checked bitwise at TP=2 in
# tests/models/test_deepseek.py, and the CLI path is the same; the suite's time on 2 cores is the budget.
@pytest.mark.parametrize("version, tp, pp, ep", [("v3", 1, 1, 2)])
def test_deepseek_converts_both_ways_bitwise(tmp_path, version, tp, pp, ep):
    """HF -> megarl checkpoint -> loaded at a TP x PP x EP layout and saved there -> HF: every tensor bitwise, the
    MTP layer (V3) left out of the model and written back, the config SGLang needs."""
    source = Path(deepseek_dir(tmp_path / "hf", version))
    original = load_file(str(source / "model.safetensors"))
    mtp = sorted(n for n in original if n.startswith("model.layers.2."))
    assert bool(mtp) == (version == "v3")
    log = convert(["hf-to-megatron", source, tmp_path / "imported"], log=tmp_path / "import.log")
    assert log.count("multi-token-prediction") == (version == "v3")
    if mtp:
        assert f"not loading the {len(mtp)} tensors of the 1 multi-token-prediction layer(s) model.layers.2.*" in log

    exported = run_distributed(_export_at_layout_rank, 2, str(source), str(tmp_path / "imported"),
                               str(tmp_path / "ckpt"), tp, pp, ep, tp=tp, pp=pp)
    assert_bitwise_equal(exported, {n: t for n, t in original.items() if n not in mtp})

    convert(["megatron-to-hf", tmp_path / "ckpt", tmp_path / "out"], log=tmp_path / "export.log")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"] if mtp else {}
    assert {index[n] for n in mtp} == ({"model-00002-of-00002.safetensors"} if mtp else set())  # after the model
    assert_bitwise_equal(read_all(tmp_path / "out"), original)
    config, source_config = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", source))
    assert {k: config[k] for k in source_config} == source_config  # nothing the source says is changed
    expected = {"moe_layer_freq": 1, "scoring_func": "sigmoid" if version == "v3" else "softmax", "ep_size": 1,
                "topk_method": "noaux_tc" if version == "v3" else "greedy",
                "num_nextn_predict_layers": 1 if version == "v3" else 0}
    assert {k: config[k] for k in expected} == expected
    batch = padded_batch(rows=4)  # transformers reads the exported directory as it reads the source
    assert torch.equal(hf_logprobs_entropy(str(tmp_path / "out"), batch)[0], hf_logprobs_entropy(str(source), batch)[0])


def test_unsupported_architectures_and_missing_keys_fail_naming_them(tmp_path, capsys):
    hf = Path(make_qwen2_dir(tmp_path / "hf", tied=False))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"architectures": ["FalconForCausalLM"],
                                                         "model_type": "falcon"}))
    assert main(["hf-to-megatron", str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unsupported model architecture ['FalconForCausalLM', 'falcon']" in err and "deepseek_v3" in err
    # a supported family whose config.json lacks a key it needs: the key and the file named, nothing written
    (hf / "config.json").write_text(json.dumps(config | {"architectures": ["MixtralForCausalLM"],
                                                         "model_type": "mixtral", "num_local_experts": 4}))
    assert main(["hf-to-megatron", str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{hf}/config.json has no 'num_experts_per_tok', which a Mixtral model needs" in err, err
    assert not (tmp_path / "out").exists()
