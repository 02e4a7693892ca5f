"""Every recipe in configs/ loads and validates (`--check-config`: no GPU, no model files), and the published
baselines' settings are what the recipes say they are."""

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.tiny import TINY_ARGS
from megarl.train import main

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
REWARD_MODEL_RECIPES = {"rm_quickstart"}  # python -m megarl.train_rm's (no RL prompts)
BASELINES = ["ppo_gsm8k_qwen2.5_0.5b", "grpo_gsm8k_qwen2.5_0.5b", "grpo_math_qwen2.5_7b", "dapo_math_qwen2.5_7b"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_dry_run(recipe, capsys):
    from megarl.train_rm import main as train_rm_main

    entry = train_rm_main if recipe.stem in REWARD_MODEL_RECIPES else main
    assert entry(["--config", str(recipe), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "config ok" in out and " is now algorithm." not in out  # the current key names (megarl/config/moved_keys.py)


def test_config_check_from_the_command_line_needs_no_model_or_gpu():
    run = subprocess.run([sys.executable, "-m", "megarl.train", "--config", str(ROOT / "configs" /
                          "dapo_math_qwen2.5_7b.yaml"), "--check-config", "model.path=/nonexistent"],
                         capture_output=True, text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr
    assert "world_size=8 = tp 2 x pp 1 x cp 1 x dp 4" in run.stdout


def recipe(name):
    return load_config(ROOT / "configs" / f"{name}.yaml")


def test_baseline_settings():
    for name in BASELINES:
        cfg = recipe(name)
        assert cfg.actor.parallel.world_size == 8 and cfg.trainer.device == "cuda", name  # one 8-GPU node
        assert cfg.actor.optim.lr == 1e-6 and cfg.data.chat_template, name
        # verl's default policy loss ("vanilla") always applies the dual clip, at c = 3
        assert (cfg.algorithm.policy_loss, cfg.algorithm.dual_clip.clip_ratio_c) == ("dual_clip", 3.0), name
    ppo, grpo = recipe("ppo_gsm8k_qwen2.5_0.5b"), recipe("grpo_gsm8k_qwen2.5_0.5b")
    assert (ppo.algorithm.advantage, ppo.algorithm.kl_in_reward, ppo.rollout.n_samples) == ("gae", True, 1)
    assert (ppo.data.prompts_per_step, ppo.actor.mini_batch_size, ppo.rollout.max_new_tokens) == (256, 64, 256)
    assert (ppo.critic.optim.lr, ppo.critic.parallel.world_size, ppo.critic.value_clip) == (1e-5, 8, 0.5)
    assert (grpo.algorithm.advantage, grpo.algorithm.kl_estimator, grpo.rollout.n_samples) == ("grpo", "k3", 5)
    for cfg in (ppo, grpo):
        assert cfg.reward.name == "gsm8k" and cfg.data.val_size == 1319 and cfg.rollout.eval_temperature == 0
    dapo = recipe("dapo_math_qwen2.5_7b").algorithm
    assert (dapo.clip_eps, dapo.clip_eps_high, dapo.kl_coef, dapo.dynamic_sampling) == (0.2, 0.28, 0.0, True)
    assert (dapo.overlong_buffer.len, dapo.loss_agg) == (4096, "token-mean")
    assert recipe("grpo_math_qwen2.5_7b").reward.name == "math"


def test_recipes_that_mirror_verl_use_its_dual_clip_loss():
    # the trap: verl's default loss ("vanilla") always applies the dual clip; found by what the recipe says
    mirrors = [p for p in RECIPES if "mirrors" in p.read_text().lower() and "verl" in p.read_text()]
    assert {p.stem for p in mirrors} >= {"ppo_gsm8k_qwen2.5_0.5b", "grpo_gsm8k_qwen2.5_0.5b", "grpo_math_qwen2.5_7b"}
    for path in mirrors:
        assert load_config(path).algorithm.policy_loss == "dual_clip", path.stem


def test_vapo_and_pfppo_recipes_turn_their_pieces_on():
    for path in sorted((ROOT / "configs").glob("vapo_*.yaml")):
        a, n = load_config(path).algorithm, load_config(path).rollout.n_samples
        # value pretraining, decoupled GAE (Monte-Carlo critic targets), length-adaptive lambda, token-level loss,
        # clip-higher, the positive-example LM loss, group sampling
        assert (a.advantage, a.gae.critic_lam, a.loss_agg) == ("gae", 1.0, "token-mean"), path.stem
        assert a.gae.critic_warmup_steps > 0 and a.gae.lam_length_alpha > 0 and a.positive_lm.coef > 0, path.stem
        assert a.clip_eps_high > a.clip_eps and n > 1, path.stem
    pfppo = [load_config(path).algorithm for path in sorted((ROOT / "configs").glob("pfppo_*.yaml"))]
    assert pfppo and all(a.pf_ppo.method in ("pow", "max_min", "max_random") for a in pfppo)


def test_unknown_algorithm_names_are_refused_before_anything_starts(capsys):
    # the registries' names, checked by python -m megarl.train before Ray, the warm start or the first rollout
    for key, typo, hint in (("advantage", "gpgg", "gpg"), ("policy_loss", "cispoo", "cispo"),
                            ("loss_agg", "token_mean", "token-mean")):
        assert main(["--check-config", *TINY_ARGS, f"algorithm.{key}={typo}"]) == 2
        err = capsys.readouterr().err
        assert f"algorithm.{key}='{typo}': unknown" in err and f"did you mean '{hint}'" in err, err
    assert main(["--check-config", *TINY_ARGS, "algorithm.policy_loss=my_pkg.losses:mine"]) == 0  # a path: imported when used


def test_the_moe_recipe_fits_one_node_as_the_planner_predicts():
    # configs/dapo_math_qwen3_30b_a3b.yaml: DAPO's settings on Qwen3-30B-A3B, experts over the 8 GPUs, and the
    # planner's numbers its comment quotes (training and each SGLang rank within an H200 of ~130 GiB usable)
    from megarl.reshard.layout import GenLayout
    from megarl.reshard.memory import GiB, MemorySettings
    from megarl.reshard.plan import load_model_config, plan, train_layout

    cfg = recipe("dapo_math_qwen3_30b_a3b")
    a, r = cfg.actor, cfg.rollout
    assert (a.parallel.world_size, a.parallel.tp, a.parallel.ep, a.use_distributed_optimizer, a.recompute) == \
        (8, 1, 8, True, "full")
    assert (r.sglang_tp, cfg.algorithm.clip_eps_high, cfg.algorithm.dynamic_sampling) == (4, 0.28, True)
    hf = load_model_config("qwen3-30b-a3b")
    layout = train_layout(hf, dict(tp=1, pp=1, cp=1, dp=8, ep=8, etp=1))
    settings = MemorySettings(seq_len=8192, distributed_optimizer=True, recompute="full")
    result = plan(hf, layout, GenLayout(r.sglang_tp), settings, traffic=False)
    serving = max(x["gen_weights"] + x["kv_cache"] for x in result["ranks"])
    assert round(result["peak"] / GiB, 1) == 85.7 and serving < 130 * GiB


@pytest.mark.parametrize("name", BASELINES + ["vapo_math_qwen2.5_7b", "dapo_math_qwen3_30b_a3b"])
def test_launch_scripts(name):
    script = ROOT / "scripts" / "recipes" / f"{name}.sh"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    assert f"configs/{name}.yaml" in script.read_text()
    # without the model directory it stops at once, naming what to set
    run = subprocess.run(["bash", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "set MODEL" in run.stderr


def test_recipe_preparation_converts_the_public_files_once(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    row = '{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n'
    (raw / "train.jsonl").write_text(row * 3)
    (raw / "test.jsonl").write_text(row)
    out = tmp_path / "data"
    command = f"source scripts/recipes/common.sh && prepare_prompts gsm8k {raw}/train.jsonl {raw}/test.jsonl {out}"
    run = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("wrote") == 2
    assert len((out / "train.jsonl").read_text().splitlines()) == 3
    run = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert run.returncode == 0 and "wrote" not in run.stdout  # already there: not converted again
