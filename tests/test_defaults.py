"""megarl's defaults are a real one-GPU run's: a run names its model and prompts, the rollout engine follows the
device, trainer.steps=0 is one pass over the prompt file, and the tiny CPU run sets its small values itself
(megarl/config/tiny.py)."""

import json

import pytest

from megarl.config import Config, ConfigError, load_config
from megarl.config.tiny import TINY_ARGS, TINY_RUN, tiny_config
from megarl.data.files import InputError
from megarl.data.inputs import prompt_datasets
from megarl.data.tasks import load_examples
from megarl.models.tiny import build_char_tokenizer
from megarl.train import main


def prompt_file(path, rows: int):
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(rows)))
    return path


def test_the_defaults_are_a_real_runs_and_the_tiny_run_sets_its_own():
    cfg = Config()
    assert (cfg.model.path, cfg.data.task) == ("", "")
    assert (cfg.rollout.engine, cfg.rollout.max_new_tokens, cfg.rollout.n_samples) == ("auto", 1024, 8)
    assert (cfg.data.prompts_per_step, cfg.data.val_size, cfg.data.chat_template) == (64, 0, True)
    assert (cfg.trainer.steps, cfg.trainer.eval_every, cfg.algorithm.lam, cfg.sft.lr) == (0, 10, 1.0, 1e-5)
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay) == (1e-6, 0.01)
    assert (cfg.critic.optim.lr, cfg.critic.optim.weight_decay) == (1e-5, 0.01)
    tiny = tiny_config()
    for key, value in TINY_RUN.items():
        section, _, name = key.rpartition(".")
        obj = tiny
        for part in section.split("."):
            obj = getattr(obj, part)
        assert getattr(obj, name) == value, key
    assert load_config(None, TINY_ARGS).to_dict() == tiny.to_dict()  # the same run from the command line


def test_a_run_without_model_or_prompts_names_both_keys_in_one_error(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model.path and data.task are not set: name model.path=<HF model directory>")
    assert "data.task=<prompts.parquet|jsonl>" in err and "bash scripts/quickstart.sh" in err
    assert err.count("\n") == 1
    assert main(["--check-config", "model.path=/models/qwen"]) == 2  # a real model and no prompts: no toy task
    assert capsys.readouterr().err.startswith("config error: data.task is not set: name data.task=")


def test_the_rollout_engine_follows_the_device(tmp_path):
    task = f"data.task={prompt_file(tmp_path / 'p.jsonl', 64)}"
    assert load_config(None, ["model.path=/m", task, "trainer.device=cpu"]).rollout.engine == "hf"
    assert load_config(None, ["model.path=/m", task, "trainer.device=cuda"]).rollout.engine == "sglang"
    cpu = load_config(None, ["model.path=/m", task, "trainer.device=cpu", "rollout.engine=sglang"])
    assert cpu.rollout.engine == "sglang"  # named: kept
    assert load_config(None, ["model.path=/m", task, "rollout.sglang_gpus=1", "trainer.device=cuda"]).rollout.engine \
        == "sglang"  # the checks of SGLang's options see the resolved engine


def test_steps_zero_is_one_pass_over_the_prompt_file(tmp_path):
    task = f"data.task={prompt_file(tmp_path / 'p.jsonl', 130)}"
    assert load_config(None, ["model.path=/m", task]).trainer.steps == 2  # 130 // 64: the partial batch dropped
    assert load_config(None, ["model.path=/m", task, "data.prompts_per_step=10"]).trainer.steps == 13
    assert load_config(None, ["model.path=/m", task, "trainer.steps=5"]).trainer.steps == 5
    with pytest.raises(ConfigError, match=r"^trainer.steps=0: one pass over data.task=.*p.jsonl \(130 rows\), fewer "
                                          r"than one step's data.prompts_per_step=200"):
        load_config(None, ["model.path=/m", task, "data.prompts_per_step=200"])
    with pytest.raises(ConfigError, match=r"^trainer.steps=0: .*data.task='reverse' is a built-in task .*set "
                                          r"trainer.steps"):
        load_config(None, ["model.path=tiny", "data.task=reverse"])
    # a file not there (a recipe checked away from its data) keeps 0, said as one pass; the run names the file
    assert load_config(None, ["model.path=/m", f"data.task={tmp_path / 'absent.parquet'}"]).trainer.steps == 0


def test_a_tokenizer_without_a_chat_template_is_named():
    cfg = load_config(None, ["model.path=tiny", "data.task=reverse", "trainer.steps=1"])
    with pytest.raises(InputError, match=r"^data.chat_template=true \(the default\) .*model.path=tiny has none: set "
                                         r"data.chat_template=false"):
        prompt_datasets(cfg, build_char_tokenizer(), None)


def test_val_size_zero_scores_every_held_out_prompt(tmp_path):
    val = prompt_file(tmp_path / "val.jsonl", 70)
    cfg = tiny_config(["data.val_size=0", f"data.task={prompt_file(tmp_path / 'p.jsonl', 16)}",
                       f"data.val_task={val}"])
    assert len(prompt_datasets(cfg, build_char_tokenizer(), None).val) == 70
    assert len(load_examples(tiny_config(["data.val_size=0"]).data, seed=0)[1]) == 256  # a built-in task's


def test_check_config_echoes_what_will_train(tmp_path, capsys):
    task = prompt_file(tmp_path / "p.jsonl", 130)
    assert main(["--check-config", "model.path=/models/qwen", f"data.task={task}", "reward.name=exact_match",
                 "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "rollout=hf; 2 RL steps" in out
    assert "responses up to 1024 tokens" in out and "batch: 64 prompts = 512 sequences per RL step" in out
    assert "steps: 2 RL steps (0.985 epochs of 130 prompts); learning rate 1e-06" in out
    assert "held-out a held-out split of the training file, all scored" in out
