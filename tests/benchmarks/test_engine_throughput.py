"""The throughput benchmark's FLOPs formula, and the script itself at a tiny size on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.engine_throughput import SIZES, flop_parameters, model_flops, qwen2_config

ROOT = Path(__file__).resolve().parents[2]


def test_flops_formula_is_the_notes_formula_for_equal_lengths():
    hf = qwen2_config("1b", 2048)
    # 1.38B parameters in notes/gpu-anchors.md, of which the input embedding (2048 x 151936) is not in N
    assert abs(flop_parameters(hf) + 2048 * 151936 - 1.38e9) < 0.01e9
    L, h, s, T = 16, 2048, 2048, 4 * 2048
    assert model_flops(hf, [s] * 4) == 6 * flop_parameters(hf) * T + 12 * L * h * s * T
    assert set(SIZES) == {"0.5b", "1b", "7b", "tiny"}
    # the 0.5b shape is Qwen2.5-0.5B's: 0.494B parameters, the tied embedding counted once (as the output layer)
    assert abs(flop_parameters(qwen2_config("0.5b", 640)) - 0.494e9) < 0.005e9
    # the 7b shape is Qwen2.5-7B's: 7.62B parameters, untied output layer
    assert abs(flop_parameters(qwen2_config("7b", 2048)) + 3584 * 152064 - 7.62e9) < 0.01e9


def test_tiny_run_writes_engine_and_bare_results(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "benchmarks/engine_throughput.py", "--size", "tiny", "--seq", "64",
                    "--sequences", "8", "--max-tokens", "128", "--steps", "1", "--warmup", "1", "--out", str(out),
                    "--profile", str(tmp_path / "profile")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and len(report["commit"]) == 40
    for name in ("engine", "bare"):
        assert report[name]["tokens_per_s"] > 0 and len(report[name]["step_seconds"]) == 1
    assert report["engine_over_bare"] > 0
    for name in ("engine", "bare"):  # --profile: one more step of each loop, its tables and trace
        assert report[name]["profile"]["wall_s"] > 0
        files = sorted(f.name for f in (tmp_path / "profile" / f"profile_{name}").iterdir())
        assert files == ["ops_by_device.txt", "ops_by_host.txt", "trace.json.gz"]
    assert 8 * 32 <= report["tokens_per_step"] <= 8 * 64  # lengths in [seq / 2, seq]
