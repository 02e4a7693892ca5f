"""Layouts that cannot work are refused early, each by its key: in the config check (`--check-config`), against
the model's config.json (`--dry-run`, megarl/config/model_layout.py) and in megatron's process groups; and the
stage rule gives the published uneven splits (61 layers over PP 8, 94 over PP 4 and 16)."""

import json

import pytest

from megarl.config import ConfigError
from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.config.model_layout import check_model_layout
from megarl.parallel.stages import stage_layers
from megarl.train import main

MOE = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
       "moe_intermediate_size": 16}
BATCH = ["data.prompts_per_step=4", "rollout.n_samples=4"]


def test_stage_rule_splits_the_published_models():
    assert stage_layers(61, 8, first=5, last=8) == (5, 8, 8, 8, 8, 8, 8, 8)
    assert stage_layers(94, 4, first=23, last=23) == (23, 24, 24, 23)
    assert stage_layers(94, 16, first=5, last=5) == (5,) + (6,) * 14 + (5,)
    assert stage_layers(3, 2, first=1) == (1, 2) and stage_layers(3, 2, last=1) == (2, 1)
    assert stage_layers(8, 2) == (4, 4) and stage_layers(8, 2, first=4, last=4, vpp=2) == (4, 4)
    for args, key in (((61, 8), "pp=8 does not divide num_hidden_layers=61"),
                      ((61, 8, 6, 6), "other 49 of num_hidden_layers=61 do not split evenly"),
                      ((3, 2, 1, 1), "no stage between them"),
                      ((6, 4, 3, 3), "at least one layer per stage"),
                      ((3, 1, 1), "uneven pipeline stages need parallel.pp > 1"),
                      ((12, 2, 3, 0, 2), "parallel.vpp=2 must divide every stage's layers")):
        with pytest.raises(ValueError, match=key):
            stage_layers(*args)


@pytest.mark.parametrize("overrides, key", [
    (["actor.parallel.world_size=4", "actor.parallel.tp=2", "actor.parallel.pp=2", "actor.parallel.ep=2",
      "actor.parallel.etp=2"],
     r"actor.parallel.ep \* actor.parallel.etp = 2 \* 2 must divide the 2 ranks of a pipeline stage"),
    (["actor.parallel.world_size=2", "actor.parallel.ep=4"], r"actor.parallel.ep \* actor.parallel.etp = 4 \* 1"),
    (["actor.parallel.etp=-1"], "actor.parallel.etp=-1"),
    (["actor.parallel.pp_first_stage_layers=1"], r"actor.parallel.pp_first_stage_layers=1: uneven pipeline stages "
                                                 r"need actor.parallel.pp > 1"),
    (["actor.parallel.world_size=2", "actor.parallel.pp=2", "actor.parallel.vpp=2",
      "actor.parallel.pp_last_stage_layers=3"], "actor.parallel.pp_last_stage_layers=3 is not divisible by "
                                                "actor.parallel.vpp=2"),
    (["critic.parallel.pp_last_stage_layers=-1"], "critic.parallel.pp_last_stage_layers=-1"),
    (["actor.parallel.sequence_parallel=true"], r"actor.parallel.sequence_parallel=true .* actor.parallel.tp=1"),
    (["critic.parallel.sequence_parallel=true"], r"critic.parallel.sequence_parallel=true .* critic.parallel.tp=1"),
    (["actor.optimizer_cpu_offload=true"], "actor.optimizer_cpu_offload=true needs actor.use_distributed_optimizer"),
    (["actor.use_distributed_optimizer=true", "actor.optimizer_cpu_offload=true",
      "actor.optimizer_offload_fraction=0"], "actor.optimizer_offload_fraction=0"),
    (["actor.use_distributed_optimizer=true", "actor.optimizer_cpu_offload=true", "trainer.save_every=5"],
     "actor.optimizer_cpu_offload=true with trainer.save_every=5: .* cannot write or load checkpoints"),
    (["actor.recompute_modules=[moe]"], "actor.recompute_modules=.*needs actor.recompute=selective"),
    (["actor.recompute=selective", "actor.recompute_modules=[moe_act]"], "moe_act needs megatron's grouped-GEMM"),
    (["actor.recompute=selective", "actor.recompute_modules=[experts]"], "'experts' is not one of"),
])
def test_config_check_refuses_layouts_by_key(overrides, key, capsys):
    with pytest.raises(ConfigError, match=key):
        tiny_config(BATCH + overrides)
    assert main(["--check-config", *TINY_ARGS] + BATCH + overrides) == 2
    assert "config error" in capsys.readouterr().err


def test_layouts_that_fit_pass_the_config_check():
    cfg = tiny_config(BATCH + ["actor.parallel.world_size=4", "actor.parallel.tp=2", "actor.parallel.ep=2",
                                     "actor.parallel.etp=1", "actor.parallel.sequence_parallel=true",
                                     "actor.use_distributed_optimizer=true", "actor.optimizer_cpu_offload=true",
                                     "actor.recompute=selective", "actor.recompute_modules=[moe,core_attn]"])
    assert (cfg.actor.parallel.etp, cfg.actor.optimizer_offload_fraction) == (1, 1.0)
    two_stages = tiny_config(BATCH + ["actor.parallel.world_size=2", "actor.parallel.pp=2",
                                            "actor.parallel.pp_first_stage_layers=1"])
    assert check_model_layout(two_stages.actor, "actor", MOE, "moe/config.json") == (1, 2)


@pytest.mark.parametrize("overrides, model, key", [
    (["actor.parallel.world_size=2", "actor.parallel.pp=2"], MOE,
     r"actor.parallel.pp=2 does not divide num_hidden_layers=3: set actor.parallel.pp_first_stage_layers"),
    (["actor.parallel.world_size=2", "actor.parallel.pp=2", "actor.parallel.pp_first_stage_layers=1",
      "actor.parallel.pp_last_stage_layers=1"], MOE, r"actor.parallel.pp_first_stage_layers=1, "
                                                     r"actor.parallel.pp_last_stage_layers=1 with actor.parallel.pp=2"),
    (["actor.parallel.world_size=4", "actor.parallel.tp=4"], MOE, "actor.parallel.tp=4 must divide "
                                                                  "num_key_value_heads=2"),
    (["actor.parallel.world_size=4", "actor.parallel.ep=4", "actor.parallel.etp=1"], {**MOE, "num_experts": 6},
     "actor.parallel.ep=4 must divide the 6 routed experts"),
    (["actor.parallel.world_size=4", "actor.parallel.ep=2", "actor.parallel.etp=2"],
     {**MOE, "moe_intermediate_size": 15}, "actor.parallel.etp=2 .* must divide each expert's moe_intermediate_size=15"),
    (["actor.parallel.world_size=4", "actor.parallel.ep=2", "actor.parallel.etp=2"],  # Mixtral: no other width key
     {"model_type": "mixtral", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
      "num_local_experts": 4, "intermediate_size": 15},
     "actor.parallel.etp=2 .* must divide each expert's intermediate_size=15"),
    (["actor.parallel.world_size=2", "actor.parallel.ep=2"], {k: v for k, v in MOE.items() if k != "num_experts"},
     "actor.parallel.ep=2 and actor.parallel.etp=0 split experts, and .* has none"),
])
def test_dry_run_refuses_layouts_the_model_cannot_take(overrides, model, key, tmp_path, capsys):
    cfg = tiny_config(BATCH + overrides)
    with pytest.raises(ConfigError, match=key):
        check_model_layout(cfg.actor, "actor", model, "moe/config.json")
    # The dry run reads the model directory's config.json and reports the same error.
    from megarl.models.tiny import build_char_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(model))
    assert main(["--dry-run", *TINY_ARGS, f"model.path={tmp_path}"] + BATCH + overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and key.split(" ")[0] in err, err


def test_process_groups_refuse_experts_that_do_not_fit_a_stage():
    from megarl.parallel.state import check_layout

    check_layout(4, tp=2, pp=1, ep=2, etp=1)
    check_layout(4, tp=1, pp=1, ep=2, etp=2)
    with pytest.raises(ValueError, match=r"ep \* etp = 2 \* 2 must divide the 2 ranks of a pipeline stage"):
        check_layout(4, tp=1, pp=2, ep=2, etp=2)
