"""verl's command lines, read by megarl: the config each becomes, key by key, and the refusals.

The commands are those of verl's guides and documentation (the GSM8K PPO quickstart, GRPO, DAPO, the multi-node
`ray job submit` of the seeds), with only the entry point changed."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import ConfigError, load_config
from megarl.config.verl import near_miss
from megarl.config.verl_keys import VERL_KEYS, markdown_table

from tests.conftest import QUICKSTART

ROOT = Path(__file__).resolve().parent.parent

# the seeds' commands as their guides print them (python3 -m verl.trainer.main_ppo ...)
SEED_PPO = """data.train_files="../data/gsm8k/train.parquet" data.val_files="../data/gsm8k/test.parquet"
data.train_batch_size=512 data.max_prompt_length=1024 data.max_response_length=512
actor_rollout_ref.model.path="Qwen/Qwen2-7B-Instruct" actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.9
critic.model.path="Qwen/Qwen2-7B-Instruct" critic.optim.lr=1e-5 trainer.n_gpus_per_node=8 trainer.nnodes=1
trainer.project_name='verl_example' trainer.experiment_name='qwen2_7b_gsm8k' trainer.total_epochs=3
trainer.logger=['console']"""
SEED_MULTINODE = """trainer.n_gpus_per_node=8 trainer.nnodes=2 data.train_batch_size=1024
actor_rollout_ref.model.path="Qwen/Qwen2-7B-Instruct" critic.model.path="Qwen/Qwen2-7B-Instruct"
trainer.project_name='verl_multinode' trainer.experiment_name='qwen2_7b_2node' trainer.total_epochs=5"""
# verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh), the seeds' algorithm guide's switches
VERL_GRPO = """algorithm.adv_estimator=grpo data.train_files={train} data.val_files={test} data.train_batch_size=1024
data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error'
actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","tensorboard"]'
trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2_7b_function_rm'
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15"""
# DAPO's switches (verl's recipe/dapo): decoupled clip, token-mean, dynamic sampling, overlong buffer
VERL_DAPO = """algorithm.adv_estimator=grpo data.train_files={train} data.val_files={test} data.train_batch_size=512
data.max_prompt_length=2048 data.max_response_length=8192 actor_rollout_ref.rollout.n=16
actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.clip_ratio_low=0.2
actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.clip_ratio_c=10.0
actor_rollout_ref.actor.loss_agg_mode=token-mean algorithm.use_kl_in_reward=False actor_rollout_ref.actor.use_kl_loss=False
algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc algorithm.filter_groups.max_num_gen_batches=10
reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096
reward_model.overlong_buffer.penalty_factor=1.0 actor_rollout_ref.rollout.temperature=1.0
actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1 actor_rollout_ref.rollout.val_kwargs.temperature=1.0
actor_rollout_ref.rollout.val_kwargs.do_sample=True actor_rollout_ref.rollout.val_kwargs.n=4
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.model.path=Qwen/Qwen2.5-32B trainer.n_gpus_per_node=8 trainer.nnodes=4 trainer.total_training_steps=200
trainer.save_freq=10 trainer.test_freq=5 trainer.resume_mode=auto actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4
custom_reward_function.path=my_reward.py"""


def read(command: str, *extra: str):
    return load_config(None, shlex.split(command) + list(extra))


def prompts(path: Path, n: int) -> str:
    """A prompt file in verl's layout with n rows."""
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i} + 1 ="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_the_seeds_ppo_quickstart_trains_ppo_with_verls_settings():
    cfg = read(SEED_PPO)
    assert cfg.profile == "verl"
    expected = {
        "algorithm.advantage": "gae", "algorithm.policy_loss": "dual_clip", "algorithm.dual_clip.clip_ratio_c": 3.0,
        "algorithm.clip_eps": 0.2, "algorithm.clip_eps_high": 0.2, "algorithm.gamma": 1.0, "algorithm.lam": 1.0,
        "algorithm.kl_coef": 0.0, "algorithm.entropy_coef": 0.0, "algorithm.loss_agg": "token-mean",
        "rollout.n_samples": 1, "rollout.max_new_tokens": 512, "data.max_prompt_length": 1024,
        "data.prompts_per_step": 512, "actor.mini_batch_size": 256, "actor.ppo_epochs": 1,
        "actor.optim.lr": 1e-6, "actor.optim.weight_decay": 0.01, "actor.optim.clip_grad": 1.0,
        "critic.optim.lr": 1e-5, "critic.optim.weight_decay": 0.01, "critic.value_clip": 0.5,
        "critic.path": "Qwen/Qwen2-7B-Instruct", "critic.ppo_epochs": 1,
        "model.path": "Qwen/Qwen2-7B-Instruct", "rollout.engine": "sglang", "rollout.sglang_tp": 2,
        "rollout.sglang_mem_fraction": 0.9, "rollout.temperature": 1.0, "rollout.eval_temperature": 0.0,
        "rollout.eval_n_samples": 1, "actor.parallel.world_size": 8, "critic.parallel.world_size": 8,
        "data.task": "../data/gsm8k/train.parquet", "data.val_task": "../data/gsm8k/test.parquet",
        "data.chat_template": True, "trainer.loggers": ["console"], "trainer.project_name": "verl_example",
        "trainer.experiment_name": "qwen2_7b_gsm8k", "trainer.output_dir": "runs/verl_example/qwen2_7b_gsm8k",
        "trainer.checkpoint_dir": "checkpoints/verl_example/qwen2_7b_gsm8k", "trainer.save_every": 0,
        "trainer.resume": "auto", "trainer.keep_last": 0, "actor.recompute": "full",
    }
    assert {key: value_of(cfg, key) for key in expected} == expected
    assert any("'vllm': megarl serves rollouts with SGLang" in note for note in cfg.notes)


def value_of(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_epochs_become_steps_from_the_training_files_rows(tmp_path):
    """verl's dataloader drops the last partial batch: 3 epochs of 1100 prompts at 512 a step are 3 x 2 steps."""
    train, test = prompts(tmp_path / "train.parquet", 1100), prompts(tmp_path / "test.parquet", 37)
    cfg = read(SEED_PPO, f"data.train_files={train}", f"data.val_files={test}")
    assert cfg.trainer.steps == 6 and cfg.data.val_size == 37
    # total_training_steps wins over epochs, as in verl
    assert read(SEED_PPO, f"data.train_files={train}", "trainer.total_training_steps=7").trainer.steps == 7
    with pytest.raises(ConfigError, match="has 100 prompts, fewer than one data.train_batch_size=512"):
        read(SEED_PPO, f"data.train_files={prompts(tmp_path / 'small.parquet', 100)}")


def test_verls_grpo_command_converts_units(tmp_path):
    train, test = prompts(tmp_path / "train.parquet", 2048), prompts(tmp_path / "test.parquet", 10)
    cfg = read(VERL_GRPO.format(train=train, test=test))
    # 256 prompts a mini-batch at 5 samples each: 1280 sequences; 2048 // 1024 x 15 epochs = 30 steps
    got = {key: value_of(cfg, key) for key in (
        "algorithm.advantage", "rollout.n_samples", "actor.mini_batch_size", "actor.micro_batch_size",
        "algorithm.kl_coef", "algorithm.kl_in_reward", "algorithm.kl_estimator", "trainer.steps", "trainer.save_every",
        "trainer.eval_every", "data.filter_overlong_prompts", "data.truncation", "trainer.loggers", "rollout.engine")}
    assert got == {"algorithm.advantage": "grpo", "rollout.n_samples": 5, "actor.mini_batch_size": 1280,
                   "actor.micro_batch_size": 40, "algorithm.kl_coef": 0.001, "algorithm.kl_in_reward": False,
                   "algorithm.kl_estimator": "k3", "trainer.steps": 30, "trainer.save_every": 20,
                   "trainer.eval_every": 5, "data.filter_overlong_prompts": True, "data.truncation": "error",
                   "trainer.loggers": ["console", "tensorboard"], "rollout.engine": "sglang"}
    # settings that mean nothing in megarl are accepted and said once each
    said = "\n".join(cfg.notes)
    assert "use_remove_padding=True: no effect" in said and "fsdp_config.param_offload=False: no effect" in said


def test_verls_dapo_command(tmp_path):
    train, test = prompts(tmp_path / "train.parquet", 600), prompts(tmp_path / "test.parquet", 10)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    cfg = read(VERL_DAPO.format(train=train, test=test).replace("my_reward.py", str(reward)))
    got = {key: value_of(cfg, key) for key in (
        "rollout.n_samples", "actor.mini_batch_size", "algorithm.clip_eps", "algorithm.clip_eps_high",
        "algorithm.dual_clip.clip_ratio_c", "algorithm.dynamic_sampling", "algorithm.max_sampling_rounds",
        "algorithm.overlong_buffer.len", "algorithm.overlong_buffer.penalty_factor", "rollout.eval_temperature",
        "rollout.eval_n_samples", "actor.optim.warmup_steps", "actor.optim.weight_decay", "trainer.steps",
        "actor.parallel.world_size", "actor.parallel.tp", "actor.parallel.sequence_parallel", "reward.name",
        "algorithm.kl_coef")}
    assert got == {"rollout.n_samples": 16, "actor.mini_batch_size": 512, "algorithm.clip_eps": 0.2,
                   "algorithm.clip_eps_high": 0.28, "algorithm.dual_clip.clip_ratio_c": 10.0,
                   "algorithm.dynamic_sampling": True, "algorithm.max_sampling_rounds": 10,
                   "algorithm.overlong_buffer.len": 4096,
                   "algorithm.overlong_buffer.penalty_factor": 1.0, "rollout.eval_temperature": 1.0,
                   "rollout.eval_n_samples": 4, "actor.optim.warmup_steps": 10, "actor.optim.weight_decay": 0.1,
                   "trainer.steps": 200, "actor.parallel.world_size": 32, "actor.parallel.tp": 4,
                   "actor.parallel.sequence_parallel": True, "reward.name": f"{reward}:compute_score",
                   "algorithm.kl_coef": 0.0}


def test_the_multinode_seed_counts_gpus_over_nodes():
    cfg = read(SEED_MULTINODE)
    assert (cfg.actor.parallel.world_size, cfg.critic.parallel.world_size) == (16, 16)
    assert cfg.data.task == os.path.expanduser("~/data/rlhf/gsm8k/train.parquet")  # verl's default files
    assert cfg.trainer.loggers == ["console", "tensorboard", "jsonl"]  # verl's wandb default needs an account


@pytest.mark.parametrize("command", [SEED_PPO, SEED_MULTINODE])
def test_the_seeds_commands_pass_check_config_in_one_round(command):
    run = subprocess.run([sys.executable, "-m", "megarl.train", *shlex.split(command), "--check-config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("profile: verl")
    text = run.stdout
    assert "algorithm: gae advantages with a critic" in text and "1 per prompt" in text
    assert re.search(r"batch: \d+ prompts = \d+ sequences per RL step; mini-batch 256 sequences", text)


def test_refusals_name_each_key_with_the_reason_in_one_error():
    with pytest.raises(ConfigError) as e:
        read(SEED_PPO, "actor_rollout_ref.rollout.name=tgi", "actor_rollout_ref.model.enable_activation_offload=True",
             "actor_rollout_ref.actor.fsdp_config.fsdp_size=8", "trainer.val_only=True", "ray_init.num_cpus=8",
             "actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True",
             "actor_rollout_ref.actor.policy_loss.loss_mode=mystery", "algorithm.adv_estimator=nope")
    text = str(e.value)
    assert text.startswith("8 problems in the command:")  # the two KL switches are one
    for line in ("actor_rollout_ref.rollout.name='tgi': megarl generates with sglang (GPU) or hf",
                 "enable_activation_offload=True: activation offload has no equivalent", "fsdp_size=8: megarl trains with Megatron",
                 "trainer.val_only=True: megarl has no evaluation-only run", "ray_init.num_cpus: megarl's Ray",
                 "use_kl_loss and algorithm.use_kl_in_reward are both on", "loss_mode='mystery': megarl has vanilla",
                 "adv_estimator='nope': megarl has"):
        assert line in text, line


def test_unknown_keys_are_all_named_and_guesses_are_only_near_misses():
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, ["use_kl_loss=true", "rollout.n=4", "trainer.stepz=3", "actor_rollout_ref.actor.foo=1",
                                 "actor.optim.lrr=1"])
    text = str(e.value)
    assert text.startswith("5 problems in the command:")
    assert "unknown config key 'trainer.stepz'; did you mean 'trainer.steps'?" in text
    assert "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'?" in text
    # not a typo of any megarl key: the verl key it stands for, never an unrelated megarl key
    assert "unknown config key 'use_kl_loss'; verl's 'actor_rollout_ref.actor.use_kl_loss' sets algorithm.kl_coef" in text
    assert "unknown config key 'rollout.n'; verl's 'actor_rollout_ref.rollout.n' sets rollout.n_samples" in text
    assert "verl key 'actor_rollout_ref.actor.foo' is not one megarl reads" in text
    assert "ignore_eos" not in text and "parallel.tp" not in text and "reward_model.path" not in text
    assert near_miss("actor_rollout_ref.model.pth", [r.key for r in VERL_KEYS]) == "actor_rollout_ref.model.path"
    assert near_miss("algorithm.use_kl_loss", ["rollout.ignore_eos", "algorithm.kl_coef"]) is None


def test_a_megarl_key_and_a_verl_key_for_one_option_clash_and_a_recipe_yields_to_the_command_line():
    with pytest.raises(ConfigError, match=r"rollout.n_samples=4 and actor_rollout_ref.rollout.n=8 set the same option"):
        read(SEED_PPO, "actor_rollout_ref.rollout.n=8", "rollout.n_samples=4")
    # beside a recipe of megarl's keys, verl's keys name megarl options (units converted) and the recipe keeps the
    # rest: 8 prompts a mini-batch at the command line's 2 samples each; no verl default moves the recipe's lengths
    cfg = load_config(QUICKSTART, ["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert cfg.profile == "megarl"
    assert (cfg.rollout.n_samples, cfg.actor.mini_batch_size, cfg.rollout.max_new_tokens) == (2, 16, 8)
    assert load_config(QUICKSTART, ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]).actor.mini_batch_size == 64
    # megarl's own keys beside verl's win over verl's defaults (the multi-node seed leaves response length unset)
    cfg = read(SEED_MULTINODE, "rollout.max_new_tokens=64", "trainer.steps=3")
    assert (cfg.rollout.max_new_tokens, cfg.trainer.steps) == (64, 3)
    assert read(SEED_MULTINODE).rollout.max_new_tokens == 512


def test_verls_pf_ppo_and_critic_warmup_set_the_keys_nested_under_their_feature():
    cfg = read(SEED_PPO, "algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=max_min",
               "algorithm.pf_ppo.weight_pow=3.0", "trainer.critic_warmup=2")
    a = cfg.algorithm
    assert (a.pf_ppo.method, a.pf_ppo.weight_pow, a.gae.critic_warmup_steps) == ("max_min", 3.0, 2)
    assert read(SEED_PPO).algorithm.pf_ppo.method == "none"  # verl's use_pf_ppo is off by default


def test_an_invalid_option_set_through_verl_names_the_verl_key():
    with pytest.raises(ConfigError, match=r"actor.mini_batch_size=256 does not divide the step's batch .* \(set by "
                                          r"verl's actor_rollout_ref.actor.ppo_mini_batch_size=256, verl's default\)"):
        read(SEED_PPO, "data.train_batch_size=4")


def test_hydra_spellings_and_lists():
    cfg = read(SEED_PPO, "+trainer.logger=[console,file]", "++actor_rollout_ref.rollout.n=2")
    assert cfg.trainer.loggers == ["console", "jsonl"] and cfg.rollout.n_samples == 2
    with pytest.raises(ConfigError, match="~trainer.logger: megarl has no key deletion"):
        read(SEED_PPO, "~trainer.logger=console")
    with pytest.raises(ConfigError, match="~critic.model.path: megarl has no key deletion"):  # Hydra's bare form
        read(SEED_PPO, "~critic.model.path")
    with pytest.raises(ConfigError, match=r"trainer.logger='console,wandb': a list of loggers is written in brackets: "
                                          r"trainer.logger=\[console,wandb\]"):
        read(SEED_PPO, "trainer.logger=console,wandb")
    # trainer.logger=['console', 'wandb'] unquoted: the shell hands over two words
    with pytest.raises(ConfigError, match=r"did the shell split a list at a space\? Quote the whole override or write "
                                          r"it without spaces, trainer.logger=\[a,b\]"):
        load_config(None, shlex.split(SEED_PPO) + ["trainer.logger=['console',", "'wandb']"])
    assert read(SEED_PPO, "trainer.logger=[console, wandb]").trainer.loggers == ["console", "wandb"]  # quoted whole


def test_cpu_runs_take_the_transformers_engine():
    cfg = read(SEED_PPO, "trainer.device=cpu", "trainer.n_gpus_per_node=1")
    assert (cfg.rollout.engine, cfg.actor.parallel.world_size, cfg.trainer.device) == ("hf", 1, "cpu")
    assert ("actor_rollout_ref.rollout.name='vllm': megarl generates with transformers, with the same sampling "
            "settings (rollout.engine=hf)") in cfg.notes


def test_the_migration_doc_shows_the_table_the_code_reads():
    doc = (ROOT / "docs" / "migrating-from-verl.md").read_text()
    assert markdown_table() in doc, "regenerate: python -m megarl.config.verl_keys (docs/migrating-from-verl.md)"
    assert len({row.key for row in VERL_KEYS}) == len(VERL_KEYS)  # one row per key


def test_a_broken_verl_reward_is_named_before_anything_starts(tmp_path, capsys):
    from megarl.train import main

    train = prompts(tmp_path / "train.parquet", 8)

    def check(name: str, source: str) -> tuple[int, str, str]:
        (tmp_path / name).write_text(source)
        code = main(shlex.split(SEED_PPO) + [
            f"data.train_files={train}", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.n_gpus_per_node=1", f"custom_reward_function.path={tmp_path / name}", "--check-config"])
        out, err = capsys.readouterr()
        return code, out, err

    signature = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    code, _, err = check("raises.py", "import json\n\n" + signature + "    return json.loads(solution_str)['score']\n")
    assert code == 2 and "custom_reward_function.path" in err and "raises.py" in err and "JSONDecodeError" in err, err
    code, _, err = check("imports.py", signature + "    return 1.0\nimport not_a_module_anywhere\n")
    assert code == 2 and "not_a_module_anywhere" in err and "line 3" in err, err
    code, out, _ = check("works.py", signature + "    return float(solution_str == ground_truth)\n")
    assert code == 0 and "reward: compute_score from" in out and "(verl signature)" in out


def test_a_verl_value_of_the_wrong_type_is_named_by_its_key_not_read_as_truthy():
    with pytest.raises(ConfigError) as e:
        read(SEED_PPO, "actor_rollout_ref.actor.optim.lr=fast", "trainer.save_freq=abc",
             "actor_rollout_ref.actor.use_kl_loss=yes_please", "data.train_batch_size=2.5")
    text = str(e.value)
    assert text.startswith("4 problems in the command:")  # no second error from the keys that read the batch size
    for line in ("actor_rollout_ref.actor.optim.lr='fast': expected a number",
                 "trainer.save_freq='abc': expected an integer",
                 "actor_rollout_ref.actor.use_kl_loss='yes_please': expected true or false",
                 "data.train_batch_size=2.5: expected an integer"):
        assert line in text, line
    # a Hydra interpolation is not taken as it is written (a run directory named '${trainer.project_name}_x')
    with pytest.raises(ConfigError, match=r"trainer.experiment_name='\$\{trainer.project_name\}_x': megarl does not "
                                          r"resolve Hydra's \$\{...\} interpolations; write the value itself"):
        read(SEED_PPO, "trainer.experiment_name=${trainer.project_name}_x")
    # what YAML leaves a string (1e-6) and verl's truthiness (0/1 for a switch) still read as verl reads them
    cfg = read(SEED_PPO, "actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.actor.use_kl_loss=0")
    assert cfg.actor.optim.lr == 3e-6 and cfg.algorithm.kl_coef == 0


def test_verls_lora_rank_is_said_in_the_start_up_lines():
    from megarl.config.summary import describe

    cfg = read(SEED_PPO, "actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]")
    assert (cfg.actor.lora.rank, cfg.actor.lora.target_modules) == (32, ["q_proj", "v_proj"])
    assert describe(cfg)[0] == ("model: Qwen/Qwen2-7B-Instruct; LoRA rank 32 (alpha 16) on q_proj, v_proj: the base "
                                "is frozen, the adapters train")
    assert describe(read(SEED_PPO))[0] == "model: Qwen/Qwen2-7B-Instruct"


def test_a_verl_data_file_megarl_cannot_read_is_refused_by_its_key_not_taken_for_a_task():
    with pytest.raises(ConfigError) as e:
        read(SEED_PPO, "data.train_files=train.csv", "data.val_files=../data/gsm8k")
    text = str(e.value)
    assert ("data.train_files='train.csv': megarl reads prompt files named *.jsonl, *.parquet, *.json (verl's parquet "
            "layout, as scripts/preprocess/*.py write it); name one of those") in text
    assert "data.val_files='../data/gsm8k': megarl reads prompt files" in text
    assert "built-in task" not in text


def test_a_verl_value_megarl_honours_differently_is_said_at_start_up():
    notes = read(SEED_PPO, "trainer.test_freq=-1").notes
    assert ("trainer.test_freq=-1: megarl evaluates before RL and after the last step all the same (verl: at most "
            "once, before training)") in notes
    assert not any(note.startswith("trainer.test_freq") for note in read(SEED_PPO, "trainer.test_freq=5").notes)
    notes = read(SEED_PPO, "actor_rollout_ref.rollout.temperature=0.7").notes
    assert any(n.startswith("actor_rollout_ref.rollout.temperature=") and "log-probs at temperature 1" in n
               for n in notes), notes
    assert not any("rollout.temperature=" in note for note in read(SEED_PPO, "actor_rollout_ref.rollout.temperature=1.0").notes)


def test_verls_hydra_config_flags_take_its_own_configs_and_refuse_others(capsys):
    from megarl.train import main

    assert main([*shlex.split(SEED_PPO), "--config-path=config", "--config-name=ppo_megatron_trainer.yaml",
                 "--check-config"]) == 0
    assert ("note: --config-name=ppo_megatron_trainer.yaml: verl's own defaults, which megarl applies to every verl "
            "key the command does not set") in capsys.readouterr().out
    assert main([*shlex.split(SEED_PPO), "--config-path=recipe/dapo/config", "--config-name=dapo_trainer",
                 "--check-config"]) == 2
    assert ("config error: --config-name=dapo_trainer: megarl does not read Hydra config files; give their keys on "
            "the command line as key=value") in capsys.readouterr().err
    assert main(["--config", str(QUICKSTART), "--config-name=ppo_trainer", "--check-config"]) == 2
    assert "this command's keys are megarl's: leave the flag out" in capsys.readouterr().err


def test_verls_dynamic_batch_size_is_said_as_the_token_budget_it_sets():
    from megarl.config.summary import describe

    cfg = read(SEED_PPO, "actor_rollout_ref.actor.use_dynamic_bsz=True",
               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8000")
    assert cfg.actor.max_tokens_per_micro_batch == 8000
    assert describe(cfg)[3].endswith("micro-batches of whole sequences up to 8000 tokens")
    assert describe(read(SEED_PPO))[3].endswith("micro-batch 8 sequences")


def test_a_bad_count_is_named_by_the_verl_key_that_holds_it_once():
    with pytest.raises(ConfigError) as e:
        read(SEED_PPO, "trainer.total_training_steps=0", "actor_rollout_ref.rollout.n=0")
    text = str(e.value)
    assert text.startswith("2 problems in the command:")  # rollout.n's readers (the mini-batch) add no line
    assert "trainer.total_training_steps=0: expected a positive integer, got 0" in text
    assert "actor_rollout_ref.rollout.n=0: expected a positive integer, got 0" in text
    assert "total_epochs" not in text and "ppo_mini_batch_size" not in text


def test_an_error_names_the_verl_key_that_is_the_megarl_option_not_the_one_whose_conversion_set_it():
    # rollout.name's conversion sets rollout.sglang_tp, from verl's rollout.tensor_model_parallel_size
    with pytest.raises(ConfigError) as e:
        read(SEED_PPO, "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
             "rollout.weight_delivery=sharded")
    assert "verl's actor_rollout_ref.rollout.tensor_model_parallel_size=3" in str(e.value)
    assert "rollout.name" not in str(e.value)


def test_an_empty_run_name_is_refused_by_its_key():
    with pytest.raises(ConfigError, match=r"trainer.project_name='': the run's directories are "
                                          r"runs/<project_name>/<experiment_name>: give it a name"):
        read(SEED_PPO, "trainer.project_name=")
    assert read(SEED_PPO, "trainer.experiment_name=a/b").trainer.output_dir == "runs/verl_example/a/b"  # as verl nests


def test_no_loggers_is_said_as_none():
    from megarl.config.summary import describe

    assert describe(read(SEED_PPO, "trainer.logger=[]"))[-1].endswith("loggers: none")


def test_a_hydra_config_file_given_to_config_names_hydras_own_sections(tmp_path):
    recipe = tmp_path / "verl_style.yaml"
    recipe.write_text("defaults:\n  - _self_\nhydra:\n  run:\n    dir: outputs\n"
                      "actor_rollout_ref:\n  rollout:\n    prompt_length: ${data.max_prompt_length}\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    text = str(e.value)
    assert text.startswith("3 problems in the command:")
    assert "- defaults: Hydra's own (the defaults list that composes config files, hydra.* settings)" in text
    assert "- hydra.run.dir: Hydra's own" in text
    assert "prompt_length='${data.max_prompt_length}': megarl does not resolve Hydra's ${...} interpolations" in text


def test_a_typo_in_a_verl_command_is_offered_verls_key_first():
    with pytest.raises(ConfigError, match=r"unknown config key 'critic.ppo_mini_batch_sise'; did you mean "
                                          r"'critic.ppo_mini_batch_size'\?"):
        read(SEED_PPO, "critic.ppo_mini_batch_sise=64")  # not megarl's critic.mini_batch_size, counted in sequences
    with pytest.raises(ConfigError, match=r"did you mean 'critic.optim.lr'\?"):  # the same key in both
        read(SEED_PPO, "critic.optim.lrr=1e-5")
