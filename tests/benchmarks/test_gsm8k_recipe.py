"""benchmarks/gsm8k_recipe.py (scripts/gpu/verify.sh PARTS=gsm8k): the synthetic GSM8K data and model go through
the recipe's own path (its launcher, scripts/preprocess/gsm8k.py, the dry run's prompt check with the chat
template), and the table's numbers from a run's metrics.jsonl."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gsm8k_recipe import prepare, table
from megarl.rewards.gsm8k import gsm8k_strict
from megarl.utils.tracking import run_dir

ROOT = Path(__file__).resolve().parents[2]


def test_synthetic_gsm8k_goes_through_the_recipe(tmp_path):
    info = prepare(tmp_path, smoke=True, device="cpu")
    assert info["rows"] == {"train": 8, "test": 4} and 100 < info["prompt_tokens"]["mean"] < 200
    raw = [json.loads(line) for line in (tmp_path / "raw" / "train.jsonl").read_text().splitlines()]
    assert all(25 <= len(r["question"].split()) <= 50 and r["question"].endswith("?") for r in raw)
    prompts = tmp_path / "prompts"
    # the recipe and scripts/launch.sh run `python`: this interpreter
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT), "MODEL": str(tmp_path / "model"),
           "GSM8K_DIR": str(tmp_path / "raw"), "GSM8K_PROMPTS": str(prompts), "RAY_AUTH_TOKEN": "unused",
           "MEGARL_LOG_DIR": str(tmp_path / "logs"), "MEGARL_CKPT_DIR": str(tmp_path / "ckpt")}
    # the smoke model has 1024 positions, the recipe's 1024 new tokens would leave no room for a prompt
    run = subprocess.run(["bash", "scripts/recipes/grpo_gsm8k_qwen2.5_0.5b.sh", "rollout.max_new_tokens=8",
                          "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "prompts ok: 8 training, 4 held-out" in run.stdout  # the recipe reads the files it converted
    converted = [json.loads(line) for line in (prompts / "train.jsonl").read_text().splitlines()]
    # the reference is the solution's "#### N", which the gsm8k reward accepts from the solution itself
    assert [c["answer"] for c in converted] == [r["answer"].rsplit("#### ", 1)[1] for r in raw]
    assert all(gsm8k_strict(r["answer"], c["answer"], {}) == 1.0 for r, c in zip(raw, converted))


def test_table_reads_step_and_verification_seconds(tmp_path):
    def run(name, rows):
        logs = run_dir(tmp_path / name, "20261206-100000-aaaa")  # a run's own directory under its output root
        logs.mkdir(parents=True)
        (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return tmp_path / name

    evaluation = {"step": 0, "val/reward": 0.0}
    default = run("default", [evaluation] + [
        {"step": s, "timing/step": t, "sync/verify_s": v, "sync/verify_deferred_s": d, "sync/verified": 1.0,
         "train/response_length": 1024.0}
        for s, t, v, d in ((1, 30.0, 5.0, 5.0), (2, 12.0, 0.02, 0.1), (3, 14.0, 0.04, 0.2), (4, 10.0, 0.03, 0.15))])
    off = run("verify_off", [evaluation] + [
        {"step": s, "timing/step": t, "sync/verify_s": 0.0, "sync/verified": 0.0, "train/response_length": 1000.0}
        for s, t in ((1, 25.0), (2, 11.0), (3, 12.0))])
    lines = table([default, off, tmp_path / "missing"]).splitlines()
    assert "synthetic" in lines[0]
    # steps 2-4: median step 12 s, verification per step (on-path + deferred) 0.12, 0.24, 0.18 -> median 0.18
    assert lines[3] == "| default | [2, 3, 4] | 12.00 | 0.180 | 1.50% | 3 | 1024 |"
    assert lines[4] == "| verify_off | [2, 3] | 11.50 | 0.000 | 0.00% | 0 | 1000 |"
    assert lines[5].startswith("| missing | no step after the warm-up")
    assert lines[6] == "median step default - verify_off: +0.50 s (+4.35% of verify_off's)"
