"""benchmarks/e2e_vs_trl.py's own logic on the CPU: the offline tokenizer's exact prompt lengths, the megarl
overrides as a valid config, the per-step numbers from a metrics file, and the deadline's clean-up."""

import json
import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.common import end_sglang_servers, run_process
from benchmarks.e2e_vs_trl import megarl_command, megarl_steps, parse_args, summarize, vowel_share, word_tokenizer
from megarl.config import load_config


def test_word_tokenizer_has_the_exact_vocab_and_prompts_of_exact_length():
    tokenizer, words = word_tokenizer(1024)
    assert len(tokenizer) == 1024 and len(words) == 1024 - 2 - 256 - 26 - 676
    assert all(len(w) == 3 for w in words)
    text = "".join(" " + w for w in words[:7] + words[-9:])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 16 and tokenizer.decode(ids) == text
    assert isinstance(tokenizer.decode(list(range(1024))), str)  # every id the model can sample decodes
    with pytest.raises(ValueError, match="vocab_size"):
        word_tokenizer(200)


def test_megarl_overrides_make_a_valid_config(tmp_path):
    args = parse_args(["--out-dir", str(tmp_path)])
    cmd = megarl_command(args, tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "v.jsonl", 256, tmp_path / "run",
                         "cuda")
    assert cmd[1:3] == ["-m", "megarl.train"]
    cfg = load_config(None, cmd[3:])
    assert (cfg.rollout.engine, cfg.rollout.ignore_eos, cfg.rollout.max_new_tokens, cfg.rollout.n_samples) == \
        ("sglang", True, 512, 8)
    assert cfg.data.prompts_per_step * cfg.rollout.n_samples == 256 and cfg.algorithm.kl_coef == 0
    assert cfg.trainer.verify_weight_sync_every == 0 and cfg.trainer.steps == 6
    assert cfg.reward.name == "benchmarks.e2e_vs_trl:vowel_share"
    assert vowel_share("abca", "", {}) == 0.5 and vowel_share("", "", {}) == 0.0


def test_bad_batch_shapes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="multiple of --n-samples"):
        parse_args(["--out-dir", str(tmp_path), "--megarl-completions", "60"])


def test_steps_and_tokens_per_second_from_a_metrics_file(tmp_path):
    rows = [{"step": 0, "val/reward": 0.1}]
    for step, seconds in ((1, 9.0), (2, 2.0), (3, 4.0)):
        rows.append({"step": step, "timing/step": seconds, "timing/generate": seconds / 2, "timing/train": 0.5,
                     "timing/offload": 0.25, "timing/new_phase": 0.0, "train/response_length": 512.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    steps = megarl_steps(tmp_path / "metrics.jsonl")
    assert [s["seconds"] for s in steps] == [9.0, 2.0, 4.0]
    assert steps[1]["phases"] == {"generation": 1.0, "update": 0.5, "memory to rollout": 0.25, "new_phase": 0.0,
                                  "other": 0.25}
    result = summarize(steps, warmup=1, completions=64, prompt_len=128)
    assert result["warmup_step_s"] == [9.0] and result["step_s"] == [2.0, 4.0] and result["mean_step_s"] == 3.0
    assert result["tokens_per_step"] == 64 * 640 and result["tokens_per_s"] == pytest.approx(64 * 640 / 3, abs=0.1)
    assert result["phase_s"]["generation"] == 1.5
    assert summarize(steps[:1], warmup=1, completions=64, prompt_len=128)["measured_steps"] == 0
    assert megarl_steps(tmp_path / "absent.jsonl") == []


def test_a_run_past_its_deadline_is_ended_with_its_leftover_servers(tmp_path):
    marker = f"/tmp/e2e-test-model-{uuid.uuid4().hex}"
    # stands in for an SGLang server the driver started in a session of its own, which outlives the driver
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "sglang.launch_server", marker],
                              start_new_session=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "sglang_30000.log").write_text("".join(f"line {i}\n" for i in range(100)) + "stuck loading\n")
    start = time.monotonic()
    record = run_process([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "x.log", 1.0, env=None,
                         leftovers=marker, server_logs=run_dir)
    assert record["status"] == "timeout" and time.monotonic() - start < 30
    assert server.wait(timeout=10) == -9
    assert end_sglang_servers(marker) == []
    # the server's last 80 lines come back beside the run's log (a run's directory does not)
    tail = (tmp_path / "x_sglang_30000.log.tail").read_text().splitlines()
    assert len(tail) == 80 and tail[0] == "line 21" and tail[-1] == "stuck loading"
    failed = run_process([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "y.log", 30, env=None)
    assert failed["status"] == "failed" and failed["returncode"] == 3
