"""A quantized checkpoint (DeepSeek-V3's block-wise FP8 release) as model.path with rollout.engine=sglang is refused
by the dry run, naming model.path, its quantization_config and the conversion to bf16; the commands it names
convert the checkpoint into one the dry run takes: bf16 weights, DeepSeek-V3's routing bias in float32 as stored."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.config import ConfigError
from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.config.model_layout import check_rollout_model
from megarl.models.tiny import build_char_tokenizer
from megarl.train import main
from tests.models.hf_families import deepseek_v3_config, save_random
from tests.test_convert_hf_checkpoint import write_fp8_copy

REPO = Path(__file__).resolve().parent.parent
BATCH = ["data.prompts_per_step=4", "rollout.n_samples=4"]
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def test_fp8_model_path_with_sglang_is_refused_naming_the_conversion_that_fixes_it(tmp_path, capsys):
    source = save_random(deepseek_v3_config(layers=2, first_k_dense_replace=1), tmp_path / "v3", seed=7)
    fp8 = tmp_path / "v3-fp8"
    write_fp8_copy(source, fp8, tmp_path / "dequantized")
    build_char_tokenizer().save_pretrained(fp8)
    hf = json.loads((fp8 / "config.json").read_text())

    sglang = tiny_config(BATCH + [f"model.path={fp8}", "rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=f"model.path={fp8} is a quantized checkpoint"):
        check_rollout_model(sglang, hf, "config.json")
    check_rollout_model(tiny_config(BATCH + [f"model.path={fp8}"]), hf, "config.json")  # the hf engine: no check

    capsys.readouterr()  # the model writers' progress bars
    assert main(["--dry-run", *TINY_ARGS, f"model.path={fp8}", "rollout.engine=sglang"] + BATCH) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: model.path={fp8} is a quantized checkpoint ({fp8}/config.json has "
                          'quantization_config={"quant_method": "fp8"'), err
    commands = [line.strip() for line in err.splitlines() if line.strip().startswith("python -m megarl.convert")]
    assert len(commands) == 2 and f"then model.path={tmp_path / 'v3-fp8-bf16'}" in err, err

    for command in commands:  # as the message says them
        argv = shlex.split(command)
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    bf16 = tmp_path / "v3-fp8-bf16"
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    assert main(["--dry-run", *TINY_ARGS, f"model.path={bf16}", "rollout.engine=sglang"] + BATCH) == 0
    written, dequantized = load_file(f"{bf16}/model.safetensors"), load_file(f"{tmp_path}/dequantized/model.safetensors")
    assert sorted(written) == sorted(dequantized)
    for name, tensor in written.items():
        if name == BIAS:  # transformers and SGLang keep it in float32: written as the checkpoint stores it
            assert tensor.dtype == torch.float32 and torch.equal(tensor, dequantized[name]), name
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, dequantized[name].bfloat16()), name
