"""benchmarks/e2e_vs_verl.py's own logic on the CPU: megarl's side as a valid config with the matched micro-batch
budget, verl's per-step numbers from its file logger, the rollout-vs-Engine and MFU arithmetic, verl's data rows
and reward. (verl's overrides were checked against verl 0.9.1's config by hydra's compose; verl is not installed
in the CPU environment.)"""

import json

import pytest

from benchmarks.e2e_vs_trl import megarl_command, summarize, vowel_share
from benchmarks.e2e_vs_verl import (parse_args, rollout_numbers, update_mfu, verl_overrides, verl_reward, verl_steps,
                                    write_verl_rows)
from megarl.config import load_config


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


def test_verl_rows_carry_the_prompt_text_and_the_same_reward(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": " ab cd", "answer": ""}\n{"prompt": " ef", "answer": "x"}\n')
    write_verl_rows(tmp_path / "p.jsonl", tmp_path / "v.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": " ab cd"}], [{"role": "user", "content": " ef"}]]
    assert rows[1]["reward_model"]["ground_truth"] == "x" and rows[1]["extra_info"]["index"] == 1
    assert verl_reward("e2e_vs_verl", "aebx", "", None) == vowel_share("aebx", "", {}) == 0.5
