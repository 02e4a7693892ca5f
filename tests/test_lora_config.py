"""actor.lora's keys: refused by name when out of range or naming an unknown projection, and verl's LoRA keys read
into them."""

import pytest

from megarl.config import ConfigError
from megarl.config.tiny import tiny_config
from megarl.config import load_config
from tests.conftest import QUICKSTART


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.rank=-1"], r"^actor.lora.rank=-1: must be in \[0, 65536\]"),
    (["actor.lora.rank=4", "actor.lora.alpha=0"], r"^actor.lora.alpha=0.0: must be in \(0, 1000000\]"),
    (["actor.lora.rank=4", "actor.lora.dropout=1"], r"^actor.lora.dropout=1.0: must be in \[0, 1\)"),
    (["actor.lora.rank=4", "actor.lora.target_modules=q_proj,qkv_proj"],
     r"^actor.lora.target_modules: 'qkv_proj' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
     r"down_proj or all-linear"),
    (["actor.lora.rank=4", "actor.lora.target_modules="], r"^actor.lora.rank=4 with actor.lora.target_modules empty"),
    (["actor.lora.rank=4", "rollout.weight_delivery=sharded"], r"^actor.lora.rank=4 with rollout.weight_delivery"),
    (["actor.lora.rank=4", "sft.steps=2", "algorithm.kl_coef=0.1"], r"^actor.lora.rank=4 with sft.steps=2"),
    (["rollout.lora_sync=adapter"], r"^rollout.lora_sync is set and actor.lora.rank=0: there are no adapters"),
    (["actor.lora.peft_dir=out/peft"], r"^actor.lora.peft_dir is set and actor.lora.rank=0"),
])
def test_invalid_lora_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(overrides)


def test_lora_keys_and_verl_keys():
    cfg = tiny_config(["actor.lora.rank=8", "actor.lora.target_modules=q_proj,v_proj"])
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    assert tiny_config().actor.lora.rank == 0  # off by default
    verl = load_config(QUICKSTART, ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                                    "actor_rollout_ref.model.target_modules=all-linear", "sft.steps=0"])
    assert (verl.actor.lora.rank, verl.actor.lora.alpha, verl.actor.lora.target_modules) == (16, 32.0, ["all-linear"])
