"""benchmarks/e2e_vs_verl.py's (and verl_model_dir.py's) own logic on the CPU: megarl's side as a valid config
with the matched micro-batch budget, verl's per-step numbers from its file logger (a run stopped at its cap
included), the rollout-vs-Engine and MFU arithmetic, verl's data rows and reward, and the model directory against
what verl asks of it: without verl, and with verl 0.9.1's own prompt
builder where its source tree is at /tmp/vpy (its tokenizer modules import on Python 3.11; verl's package
__init__ does not, so it is skipped). (verl's overrides were checked against verl 0.9.1's config by hydra's
compose; verl is not installed in the CPU environment.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.e2e_vs_trl import SMOKE_MODEL, build_model, megarl_command, summarize, vowel_share
from benchmarks.e2e_vs_verl import (ROOT, parse_args, rollout_numbers, side_record, table, update_mfu,
                                    verl_overrides, verl_reward, verl_steps, write_verl_rows)
from benchmarks.verl_model_dir import PLAIN_CHAT_TEMPLATE, QWEN_CHAT_TOKENS, model_dir_problems
from megarl.config import load_config

VERL_SRC = Path("/tmp/vpy")  # verl 0.9.1's site-packages tree (with transformers 5.9.0 beside it)
PROMPT = " abc abd abe abf"


def test_both_sides_get_the_same_batch_and_micro_batch_budget(tmp_path):
    args = parse_args(["--out-dir", str(tmp_path), "--megarl-old-logprobs", "always"])
    cmd = megarl_command(args, tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "v.jsonl", args.completions,
                         tmp_path / "run", "cuda")
    cfg = load_config(None, cmd[3:] + ["actor.max_tokens_per_micro_batch=10240",
                                       "algorithm.recompute_old_logprobs=always"])
    assert cfg.data.prompts_per_step * cfg.rollout.n_samples == 256 and cfg.trainer.steps == 5
    verl = dict(o.split("=", 1) for o in verl_overrides(args, tmp_path / "m", tmp_path / "t", tmp_path / "v",
                                                        tmp_path / "run", tmp_path / "r.py"))
    assert int(verl["data.train_batch_size"]) * int(verl["actor_rollout_ref.rollout.n"]) == 256
    assert verl["actor_rollout_ref.actor.ppo_mini_batch_size"] == verl["data.train_batch_size"]  # one update
    assert int(verl["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]) == 16 * 640 == 10240
    assert verl["trainer.total_training_steps"] == "5" and verl["actor_rollout_ref.rollout.ignore_eos"] == "true"
    # verl gives rollout.ignore_eos to vLLM only: SGLang's server default carries it
    preferred = verl["+actor_rollout_ref.rollout.engine_kwargs.sglang.preferred_sampling_params"]
    assert json.loads(preferred.strip("'")) == {"ignore_eos": True}
    # verl's fused head (its unfused log-probs loop over every token without flash-attn); off = verl's default
    assert verl["actor_rollout_ref.model.use_fused_kernels"] == "true"
    assert verl["actor_rollout_ref.model.fused_kernel_options.impl_backend"] == "torch"
    off = parse_args(["--out-dir", str(tmp_path), "--verl-fused-kernels", "off", "--verl-warmup", "1",
                      "--verl-steps", "2"])
    verl = dict(o.split("=", 1) for o in verl_overrides(off, tmp_path / "m", tmp_path / "t", tmp_path / "v",
                                                        tmp_path / "run", tmp_path / "r.py"))
    assert verl["actor_rollout_ref.model.use_fused_kernels"] == "false"
    assert "actor_rollout_ref.model.fused_kernel_options.impl_backend" not in verl
    # per-side step counts: verl's own, megarl's from --warmup/--steps
    assert verl["trainer.total_training_steps"] == "3" and (off.megarl_warmup, off.megarl_steps) == (2, 3)


def test_steps_rollout_and_mfu_from_verl_metrics(tmp_path):
    rows = []
    for step, seconds in ((1, 30.0), (2, 10.0), (3, 12.0)):
        rows.append({"step": step, "data": {"timing_s/step": seconds, "timing_s/gen": 4.0, "timing_s/reward": 0.5,
                                            "timing_s/old_log_prob": 1.0, "timing_s/update_actor": 2.0,
                                            "timing_s/update_weights": 0.5, "response_length/mean": 512.0}})
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    steps = verl_steps(tmp_path / "m.jsonl")
    assert [s["seconds"] for s in steps] == [30.0, 10.0, 12.0]
    assert steps[1]["phases"] == {"generation": 4.0, "reward": 0.5, "log-probs": 1.0, "update": 2.0,
                                  "weight sync": 0.5, "other": 2.0}
    record = summarize(steps, warmup=1, completions=256, prompt_len=128)
    assert record["mean_step_s"] == 11.0 and record["tokens_per_s"] == pytest.approx(256 * 640 / 11, abs=0.1)
    numbers = rollout_numbers(record, {"generated_tokens_per_s": 65536.0}, 256)
    assert numbers == {"rollout_tokens_per_s": 32768.0, "engine_tokens_per_s": 65536.0, "rollout_vs_engine": 0.5}
    shape = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 32}
    n = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16) + 8 * 32  # 2-D weights but the input embedding
    assert update_mfu(shape, 4, 10, 2.0, 1e3) == pytest.approx((6 * n * 40 + 12 * 2 * 8 * 4 * 100) / 2.0 / 1e3)
    assert verl_steps(tmp_path / "absent.jsonl") == []


def test_a_side_stopped_at_its_cap_is_summarised_over_the_steps_it_logged(tmp_path):
    """verl stopped by its cap after 4 of 2 + 3 steps, its 5th line cut off mid-write: 2 measured steps, 'partial';
    stopped within its warm-up: no numbers, still 'timeout'."""
    lines = [json.dumps({"step": i, "data": {"timing_s/step": seconds, "timing_s/gen": 4.0,
                                             "timing_s/update_actor": 2.0, "response_length/mean": 512.0}})
             for i, seconds in enumerate((80.0, 12.0, 10.0, 14.0), start=1)]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "data": {"timing_s/st')
    steps = verl_steps(tmp_path / "m.jsonl")
    assert [s["seconds"] for s in steps] == [80.0, 12.0, 10.0, 14.0]
    args = parse_args(["--out-dir", str(tmp_path), "--verl-warmup", "2", "--verl-steps", "3"])
    shape = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 32}
    stopped = {"status": "timeout", "log": "verl.log"}
    record = side_record(args, "verl", shape, stopped, steps, {})
    assert record["status"] == "partial" and (record["completed_steps"], record["planned_steps"]) == (4, 5)
    assert record["measured_steps"] == 2 and record["step_s"] == [10.0, 14.0] and record["mean_step_s"] == 12.0
    assert record["warmup_step_s"] == [80.0, 12.0] and record["phase_s"]["update"] == 2.0
    assert record["tokens_per_s"] == pytest.approx(256 * 640 / 12.0, abs=0.1) and record["update_mfu"] > 0
    assert "| verl | partial (4 of 5 steps) | 2 | 12.0 |" in table({"runs": {"verl": record}})
    # an Engine probed without its side (--runs '' --probe verl: at 3B the two do not fit one call) gets a row
    probed = table({"runs": {}, "probes": {"verl": {"status": "ok", "generated_tokens_per_s": 35218.5}}})
    assert "| verl's sglang.Engine alone | ok | | | | | | 35218.5 |" in probed
    early = side_record(args, "verl", shape, stopped, steps[:2], {})
    assert early["status"] == "timeout" and early["measured_steps"] == 0 and "tokens_per_s" not in early


def test_verl_rows_carry_the_prompt_text_and_the_same_reward(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": " ab cd", "answer": ""}\n{"prompt": " ef", "answer": "x"}\n')
    write_verl_rows(tmp_path / "p.jsonl", tmp_path / "v.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": " ab cd"}], [{"role": "user", "content": " ef"}]]
    assert rows[1]["reward_model"]["ground_truth"] == "x" and rows[1]["extra_info"]["index"] == 1
    assert verl_reward("e2e_vs_verl", "aebx", "", None) == vowel_share("aebx", "", {}) == 0.5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The benchmark's model directory, and one with the tokenizer of the first GPU attempt (no Qwen chat tokens)."""
    root = tmp_path_factory.mktemp("models")
    build_model(root / "now", SMOKE_MODEL, "cpu", special_tokens=QWEN_CHAT_TOKENS, chat_template=PLAIN_CHAT_TEMPLATE)
    build_model(root / "old", SMOKE_MODEL, "cpu", chat_template=PLAIN_CHAT_TEMPLATE)
    return root / "now", root / "old"


def test_model_dir_meets_verls_requirements_in_the_same_vocabulary(model_dirs):
    now, old = model_dirs
    assert model_dir_problems(now, PROMPT, 4, 8) == []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(now)
    assert len(tokenizer) == SMOKE_MODEL["vocab_size"]  # the vocabulary, so the LM head's cost, does not grow
    assert tokenizer.convert_tokens_to_ids(list(QWEN_CHAT_TOKENS)) == [2, 3, 4]
    assert tokenizer.decode([4, *tokenizer.encode(PROMPT)], skip_special_tokens=True) == PROMPT
    problems = model_dir_problems(old, PROMPT, 4, 8)
    assert len(problems) == 3 and all("tokenizer does not define" in p for p in problems)
    assert model_dir_problems(now, PROMPT, 5, 8)[0].startswith("the chat template renders a 5-token prompt as 4")
    assert "max_position_embeddings=256" in model_dir_problems(now, PROMPT, 4, 252)[0]


@pytest.mark.skipif(not (VERL_SRC / "verl").is_dir(), reason=f"verl 0.9.1's source tree is not at {VERL_SRC}")
def test_verls_own_prompt_builder_takes_the_model_dir(model_dirs):
    """verl's tokenizer loader and agent-loop prompt builder (transformers 5.9.0, as verl runs) on both directories:
    the benchmark's gives megarl's prompt ids; the old one fails as the first GPU attempt did."""
    now, old = model_dirs
    script = f"""
import sys, types
for name in ("verl", "verl.utils"):  # their __init__ imports tensordict, built for Python 3.12 only
    module = types.ModuleType(name)
    module.__path__ = [{str(VERL_SRC)!r} + "/" + name.replace(".", "/")]
    sys.modules[name] = module
import transformers
from pathlib import Path
from benchmarks.verl_model_dir import verl_prompt_check
print(transformers.__version__, verl_prompt_check(Path({str(now)!r}), {PROMPT!r}))
try:
    verl_prompt_check(Path({str(old)!r}), {PROMPT!r})
except ValueError as error:
    print(error)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(VERL_SRC), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoTokenizer

    version, ids = done.stdout.splitlines()[0].split(" ", 1)
    assert version == "5.9.0" and json.loads(ids) == AutoTokenizer.from_pretrained(now)(PROMPT)["input_ids"]
    assert done.stdout.splitlines()[1] == "Tokenizer does not define required token '<|im_end|>'"
