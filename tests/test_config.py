import pytest

from megarl.config import ConfigError, all_keys, help_text
from megarl.config.tiny import tiny_config
from tests.conftest import QUICKSTART


def test_defaults_yaml_and_overrides_compose(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  parallel: {world_size: 4, tp: 2}\n  optim: {lr: 0.001}\ntrainer: {steps: 7}\n")
    cfg = tiny_config(["trainer.steps=3", "actor.optim.lr=1e-4", "trainer.loggers=console,jsonl"], path=recipe)
    assert cfg.actor.parallel.world_size == 4 and cfg.actor.parallel.tp == 2 and cfg.actor.parallel.dp == 2
    assert cfg.trainer.steps == 3  # the command line wins over the recipe
    assert cfg.actor.optim.lr == pytest.approx(1e-4) and isinstance(cfg.actor.optim.lr, float)
    assert cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.rollout.n_samples == 8  # untouched default


def test_unknown_key_names_the_closest_valid_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.paralel.tp'; did you mean 'actor.parallel.tp'\?"):
        tiny_config(["actor.paralel.tp=2"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  n_sample: 4\n")
    with pytest.raises(ConfigError, match=r"'rollout.n_sample'; did you mean 'rollout.n_samples'"):
        tiny_config([], path=recipe)


def test_a_key_of_another_training_role_names_the_roles_it_applies_to(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'reward_model.ppo_epochs' does not apply to reward_model: "
                                          r"ppo_epochs is a key of actor and critic only \(actor.ppo_epochs, "
                                          r"critic.ppo_epochs\)"):
        tiny_config(["reward_model.ppo_epochs=2"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("critic:\n  fp32_lm_head: false\n")
    with pytest.raises(ConfigError, match=r"'critic.fp32_lm_head' does not apply to critic: fp32_lm_head is a key "
                                          r"of actor only \(actor.fp32_lm_head\)"):
        tiny_config([], path=recipe)
    with pytest.raises(ConfigError, match=r"'actor.value_clip' does not apply to actor: value_clip is a key of "
                                          r"critic only"):
        tiny_config(["actor.value_clip=0.2"])
    assert tiny_config(["critic.ppo_epochs=2"]).critic.ppo_epochs == 2


def test_a_typo_of_another_roles_key_names_the_key_and_its_roles():
    with pytest.raises(ConfigError, match=r"unknown config key 'reward_model.ppo_epoch'; did you mean ppo_epochs\? It "
                                          r"is a key of actor and critic only \(actor.ppo_epochs, critic.ppo_epochs\), "
                                          r"not of reward_model"):
        tiny_config(["reward_model.ppo_epoch=2"])
    # a typo of the role's own key is named as such
    with pytest.raises(ConfigError, match=r"'reward_model.mini_batch_siz'; did you mean "
                                          r"'reward_model.mini_batch_size'"):
        tiny_config(["reward_model.mini_batch_siz=4"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"'trainer.steps' expects int, got 'many'"):
        tiny_config(["trainer.steps=many"])
    with pytest.raises(ConfigError, match=r"'actor.parallel.tp' expects int, got 1.5"):
        tiny_config(["actor.parallel.tp=1.5"])


def test_env_sections_are_checked_by_key():
    cfg = tiny_config(["trainer.worker_env={NCCL_DEBUG: INFO}", "rollout.sglang_env={CUDA_MPS_CLIENT_PRIORITY: 0}"])
    assert cfg.trainer.worker_env == {"NCCL_DEBUG": "INFO"} and cfg.rollout.sglang_env == {"CUDA_MPS_CLIENT_PRIORITY": 0}
    with pytest.raises(ConfigError, match=r"trainer.worker_env: '1X' is not an environment variable name"):
        tiny_config(["trainer.worker_env={1X: a}"])
    with pytest.raises(ConfigError, match=r"rollout.sglang_env: CUDA_VISIBLE_DEVICES is set by megarl"):
        tiny_config(["rollout.sglang_env={CUDA_VISIBLE_DEVICES: '0'}"])
    with pytest.raises(ConfigError, match=r"rollout.sglang_env.A=\[1\]: an environment variable's value must be"):
        tiny_config(["rollout.sglang_env={A: [1]}"])
    with pytest.raises(ConfigError, match=r"trainer.worker_env=\[.A.\]: expected a mapping"):
        tiny_config(["trainer.worker_env=[A]"])

def test_extra_sglang_arguments_reach_the_server_and_megarls_own_are_refused():
    cfg = tiny_config(["rollout.engine=sglang", "rollout.sglang_args=[--cuda-graph-max-bs-decode, 512]"])
    assert cfg.rollout.sglang_args == ["--cuda-graph-max-bs-decode", 512]
    with pytest.raises(ConfigError, match=r"rollout.sglang_args: --tp-size is set by megarl .*rollout.sglang_tp"):
        tiny_config(["rollout.engine=sglang", "rollout.sglang_args=[--tp-size=2]"])
    with pytest.raises(ConfigError, match=r"extra SGLang arguments need rollout.engine=sglang \(got hf\)"):
        tiny_config(["rollout.sglang_args=[--attention-backend, fa3]"])


def test_inconsistent_layout_is_an_error():
    with pytest.raises(ConfigError, match=r"world_size=3 is not divisible by actor.parallel.tp \* actor.parallel.pp "
                                          r"\* actor.parallel.cp = 2\*1\*1"):
        tiny_config(["actor.parallel.world_size=3", "actor.parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"actor.mini_batch_size=6 does not divide the step's batch"):
        tiny_config(["data.prompts_per_step=2", "rollout.n_samples=4", "actor.mini_batch_size=6"])
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm': must be one of auto, hf, sglang"):
        tiny_config(["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match=r"critic.parallel.world_size=2 is not divisible by critic.parallel.tp "
                                          r"\* critic.parallel.pp \* critic.parallel.cp = 1\*1\*4"):
        tiny_config(["critic.parallel.world_size=2", "critic.parallel.cp=4"])
    with pytest.raises(ConfigError, match=r"actor.parallel.cp=2 with actor.parallel.ep=2: context parallelism with "
                                          "expert parallelism is not supported"):
        tiny_config(["actor.parallel.world_size=8", "actor.parallel.cp=2", "actor.parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"actor.attention='varlen' does not run context parallelism "
                                          r"\(actor.parallel.cp=2\)"):
        tiny_config(["actor.parallel.world_size=2", "actor.parallel.cp=2", "actor.attention=varlen"])
    cfg = tiny_config(["actor.parallel.world_size=8", "actor.parallel.tp=2", "actor.parallel.cp=2"])
    assert cfg.actor.parallel.dp == 2  # 8 ranks = TP 2 x CP 2 x DP 2
    with pytest.raises(ConfigError, match=r"critic.packing='one_rows': must be one of rows, one_row"):
        tiny_config(["critic.packing=one_rows"])
    # one_row is the default of every training role, also without a token budget (with varlen attention it then packs
    # micro_batch_size x the longest sequence per micro-batch)
    default = tiny_config()
    assert (default.actor.packing, default.critic.packing, default.reward_model.packing) == ("one_row",) * 3
    assert tiny_config(["actor.packing=rows", "actor.max_tokens_per_micro_batch=4096"]).actor.packing == "rows"


def test_missing_recipe_and_section_misuse():
    with pytest.raises(ConfigError, match="config file not found"):
        tiny_config([], path="/nonexistent/recipe.yaml")
    with pytest.raises(ConfigError, match="'actor' is a section"):
        tiny_config(["actor=3"])


def test_malformed_recipe_names_the_file_and_where_yaml_stopped(tmp_path, capsys):
    from megarl.train import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  steps: 3\n   eval_every: 1\n")  # a stray indent
    with pytest.raises(ConfigError, match=rf"config file {recipe}: not valid YAML: mapping values are not allowed "
                                          r"here at line 3, column 14"):
        tiny_config([], path=recipe)
    recipe.write_bytes(b"trainer:\n  output_dir: \"runs/\xff\"\n")
    with pytest.raises(ConfigError, match=rf"config file {recipe}: not valid UTF-8 \(byte 0xff at line 2, column 21\)"):
        tiny_config([], path=recipe)
    with pytest.raises(ConfigError, match=r"override 'trainer.loggers=\[console,': the value is not valid YAML"):
        tiny_config(["trainer.loggers=[console,"])
    assert main(["--config", str(recipe), "--check-config"]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith(f"config error: config file {recipe}: not valid UTF-8") and err.count("\n") == 1


def test_help_lists_every_key_with_its_default():
    text = help_text()
    for key in all_keys():
        assert key in text
    assert "actor.parallel.tp = 1" in text


def test_recipes_in_configs_validate():
    import pathlib
    recipes = sorted(pathlib.Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
    assert recipes, "no recipes found"
    for recipe in recipes:
        tiny_config([], path=recipe)


def test_weight_delivery_and_offload_options_are_checked():
    sharded_sglang = ["rollout.engine=sglang", "rollout.weight_delivery=sharded", "actor.parallel.world_size=2"]
    # a generation TP other than the training TP, pipeline stages, SGLang's expert parallelism: the resharder's layouts
    for more in (["rollout.sglang_tp=2"], ["actor.parallel.pp=2"], ["actor.parallel.tp=2", "rollout.sglang_tp=2"],
                 ["actor.parallel.ep=2", "rollout.sglang_tp=2", "rollout.sglang_args=[--ep-size,2]"]):
        assert tiny_config(sharded_sglang + more).rollout.weight_delivery == "sharded"
    # an SGLang setting that places weights otherwise: refused by name where the placement matters (sharded delivery,
    # checksums), free for full delivery verified by the deep check
    deepep = ["rollout.sglang_tp=2", "rollout.sglang_args=[--ep-size,2,--moe-a2a-backend,deepep]"]
    with pytest.raises(ConfigError, match=r"rollout.sglang_args: --moe-a2a-backend deepep places SGLang's weights "
                                          r"otherwise than megarl models them .*rollout.weight_delivery=sharded"):
        tiny_config(sharded_sglang + deepep)
    with pytest.raises(ConfigError, match=r"--enable-dp-attention places SGLang's weights otherwise.*"
                                          r"weight_delivery=full, trainer.verify_weight_sync_every=1\)"):
        tiny_config(["rollout.engine=sglang", "trainer.verify_weight_sync_every=1",
                           "rollout.sglang_args=[--enable-dp-attention,--dp-size=1]"])
    assert tiny_config(["rollout.engine=sglang", "trainer.verify_weight_sync_deep=true"] + deepep)
    with pytest.raises(ConfigError, match=r"rollout.sglang_tp=3 \(the generation TP\) must divide actor.parallel.world_size=2"):
        tiny_config(["actor.parallel.world_size=2", "rollout.weight_delivery=sharded", "rollout.sglang_tp=3"])
    with pytest.raises(ConfigError, match=r"trainer.offload_between_phases='sometimes': must be one of auto, always, never"):
        tiny_config(["trainer.offload_between_phases=sometimes"])
    assert tiny_config(["actor.parallel.world_size=2", "actor.parallel.tp=2", "rollout.weight_delivery=sharded",
                              "rollout.sglang_tp=2"]).rollout.weight_delivery == "sharded"


def test_disaggregated_sglang_options_are_checked():
    with pytest.raises(ConfigError, match=r"rollout.sglang_gpus=2 reserves GPUs for SGLang servers: it needs "
                                          r"rollout.engine=sglang \(got hf\)"):
        tiny_config(["rollout.sglang_gpus=2"])
    with pytest.raises(ConfigError, match=r"rollout.sglang_gpus=3 must be a multiple of rollout.sglang_tp=2"):
        tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=3", "rollout.sglang_tp=2"])
    with pytest.raises(ConfigError, match=r"rollout.sglang_gpus=-1: must be in \[0, 100000\] \(0 = the servers share"):
        tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=-1"])
    with pytest.raises(ConfigError, match=r"trainer.offload_between_phases=always with rollout.sglang_gpus=1"):
        tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=1", "trainer.offload_between_phases=always"])
    with pytest.raises(ConfigError, match=r"rollout.weight_delivery=sharded with rollout.engine=sglang needs colocated "
                                          r"servers \(rollout.sglang_gpus=0, got 1"):
        tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=1", "rollout.weight_delivery=sharded"])
    # auto: the offload cycle runs only where training and SGLang share GPUs
    disaggregated = tiny_config(["rollout.engine=sglang", "rollout.sglang_gpus=4", "rollout.sglang_tp=2"])
    assert not disaggregated.offload_enabled("cuda")
    assert tiny_config(["rollout.engine=sglang"]).offload_enabled("cuda")


def test_the_start_up_line_names_expert_parallelism_and_uneven_stages():
    plain = tiny_config(["actor.parallel.world_size=4", "actor.parallel.tp=2"]).actor.parallel
    assert plain.describe() == "world_size=4 = tp 2 x pp 1 x cp 1 x dp 2"
    moe = tiny_config(["actor.parallel.world_size=8", "actor.parallel.pp=2", "actor.parallel.ep=2",
                             "actor.parallel.pp_first_stage_layers=3", "actor.parallel.pp_last_stage_layers=1"])
    assert moe.actor.parallel.describe() == ("world_size=8 = tp 1 x pp 2 x cp 1 x dp 4 (ep 2, first stage 3 layers, "
                                             "last stage 1 layers)")


def test_check_config_says_where_generation_runs(capsys):
    from megarl.train import main

    for overrides, says in (
            ([], "rollout=hf;"),
            (["rollout.engine=sglang", "rollout.sglang_tp=2"],
             "rollout=sglang: servers of TP 2 on the training GPUs (colocated);"),
            (["rollout.engine=sglang", "rollout.sglang_gpus=4"],
             "rollout=sglang: 4 servers of TP 1 on the rollout actor's node (4 GPUs of their own);"),
            (["rollout.engine=sglang", "rollout.sglang_gpus=16", "rollout.sglang_tp=4", "rollout.sglang_gpus_per_host=8"],
             "rollout=sglang: 4 servers of TP 4 on 2 server hosts of 8 GPUs (16 GPUs of their own);"),
            (["rollout.engine=sglang", "rollout.sglang_gpus=8", "rollout.sglang_tp=8", "rollout.sglang_gpus_per_host=8"],
             "rollout=sglang: 1 server of TP 8 on 1 server host of 8 GPUs (8 GPUs of their own);")):
        assert main(["--config", str(QUICKSTART), "--check-config", *overrides]) == 0
        assert says in capsys.readouterr().out
