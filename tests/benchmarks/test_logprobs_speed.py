"""The log-prob benchmark script at a tiny size on the CPU: every mode times both formulas, which agree."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_times_both_formulas_and_they_agree(tmp_path):
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "benchmarks/logprobs_speed.py", "--tokens", "48", "--vocab", "300",
                    "--repeats", "1", "--device", "cpu", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and [r["mode"] for r in report["rows"]] == [
        "logprobs", "entropy_metric", "entropy_grad"]
    for row in report["rows"]:
        assert row["baseline"]["ms"] > 0 and row["chunked"]["ms"] > 0
        diff = row["max_abs_diff"]
        assert diff["logprobs"] < 1e-4 and diff["grad"] < 1e-3
        assert (diff["entropy"] is None) == (row["mode"] == "logprobs")
        assert diff["entropy"] is None or diff["entropy"] < 1e-4
