"""Qwen2.5-VL's (and Qwen3-VL's) vision tower in the weight inventory and in SGLang's layout (megarl.reshard.inventory,
megarl.rollout.weight_layout): every tower tensor of the tiny model's checkpoint is listed, and the senders' checksums
of the tower equal those of the tensors as SGLang 0.5.17's Qwen2_5_VLForConditionalGeneration loads them (written
out here from its load_weights: attn.qkv -> attn.qkv_proj, gate/up fused with the MLP width padded to a multiple
of 8, down_proj's columns padded)."""

import json

import pytest
import torch
from safetensors import safe_open

from megarl.config.model_layout import check_model_layout
from megarl.config.sections import ActorConfig
from megarl.reshard.inventory import hf_inventory
from megarl.rollout.sglang_layout import check_presharded_tower
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
from megarl.utils.checksum import module_checksums
from megarl.workers.weight_sync import WeightSyncError, verify_checksums

VISION = {"depth": 2, "hidden_size": 8, "intermediate_size": 12, "num_heads": 2, "out_hidden_size": 16,
          "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}
VL = {"model_type": "qwen2_5_vl", "tie_word_embeddings": False, "vision_config": VISION,
      "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 16, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 100}}


def test_inventory_lists_every_checkpoint_tensor_of_the_tiny_vl_model(tmp_path):
    from megarl.models.tiny_vl import build_tiny_vl_model

    model = build_tiny_vl_model(tmp_path / "vl")
    hf = json.loads((model / "config.json").read_text())
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    listed = {s.name: s.shape for s in hf_inventory(hf)}
    assert listed == saved
    assert {s.dim for s in hf_inventory(hf) if s.name.startswith("visual.")} == {None}  # replicated
    flat = {k: v for k, v in hf.items() if k != "text_config"} | hf["text_config"] | {"model_type": "qwen2_5_vl"}
    assert [s.name for s in hf_inventory(flat)] == [s.name for s in hf_inventory(hf)]  # published config.json
    assert check_model_layout(ActorConfig(), "actor", hf, "config.json") == (2,)  # text_config's layers


def _sglang_tower(full: dict) -> dict:
    """The tower's tensors as SGLang's loader leaves them on every rank."""
    align = lambda n: -(-n // 8) * 8  # noqa: E731
    held = {}
    for name, t in full.items():
        if ".mlp.up_proj." in name or not name.startswith("visual."):
            continue
        if ".mlp.gate_proj." in name:
            gate, up = t, full[name.replace("gate_proj", "up_proj")]
            pad = lambda x: torch.cat([x, x.new_zeros(align(x.shape[0]) - x.shape[0], *x.shape[1:])])  # noqa: E731
            held[name.replace("gate_proj", "gate_up_proj")] = torch.cat([pad(gate), pad(up)])
        elif name.endswith(".mlp.down_proj.weight"):
            held[name] = torch.cat([t, t.new_zeros(t.shape[0], align(t.shape[1]) - t.shape[1])], 1)
        else:
            held[name.replace(".attn.qkv.", ".attn.qkv_proj.")] = t
    return held


@pytest.mark.parametrize("tp", [1, 2])
def test_tower_checksums_equal_sglang_loaded_tower(tp):
    specs = [s for s in hf_inventory(VL) if s.name.startswith("visual.")]
    g = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in specs}
    expected = ExpectedChecksums(layout_for(specs, "sglang", tp), list(range(tp)))
    for name, t in full.items():
        expected.add(name, t)

    class Held:
        def __init__(self, tensors):
            self.tensors = tensors

        def named_parameters(self):
            return iter(self.tensors.items())

    tower = _sglang_tower(full)
    assert tower["visual.blocks.0.mlp.gate_up_proj.weight"].shape == (32, 8)  # 12 rows padded to 16, twice
    held = {0: {rank: module_checksums(Held(tower)) for rank in range(tp)}}
    verify_checksums(expected.result(), held)

    held[0][tp - 1]["visual.blocks.1.mlp.gate_up_proj.bias"][2] += 1
    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank {tp - 1}: visual.blocks.1.mlp.gate_up_proj"):
        verify_checksums(expected.result(), held)


def test_sharded_delivery_refuses_a_tower_that_sglang_pads():
    check_presharded_tower(hf_inventory(VL | {"vision_config": VISION | {"intermediate_size": 16}}))
    with pytest.raises(ValueError, match=r"visual.blocks.0.mlp.gate_proj.weight: .* width 12 .* rollout.weight_delivery=full"):
        check_presharded_tower(hf_inventory(VL))


QWEN3_VL = {"model_type": "qwen3_vl", "tie_word_embeddings": False,
            "vision_config": VISION | {"num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 16, "num_attention_heads": 4, "head_dim": 8,
                            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 24,
                            "vocab_size": 100}}


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_vl_checksums_equal_sglang_loaded_model(tp):
    """Qwen3-VL: the language model loaded as SGLang's Qwen3-VL load_weights renames it (model.language_model. ->
    model., into the fake server's qwen3 rank), the tower whole on every rank under visual. with attn.qkv_proj."""
    from tests.rollout import fake_sglang

    specs = hf_inventory(QWEN3_VL)
    g = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in specs}
    expected = ExpectedChecksums(layout_for(specs, "sglang", tp), list(range(tp)))
    for name, t in full.items():
        expected.add(name, t)
    language = {k: v for k, v in QWEN3_VL.items() if k not in ("text_config", "vision_config")} | \
        QWEN3_VL["text_config"] | {"model_type": "qwen3"}
    tower = {name.replace("model.visual.", "visual.").replace(".attn.qkv.", ".attn.qkv_proj."): t
             for name, t in full.items() if name.startswith("model.visual.")}
    assert "visual.deepstack_merger_list.0.linear_fc1.weight" in tower and "visual.pos_embed.weight" in tower

    class Held:
        def __init__(self, tensors):
            self.tensors = tensors

        def named_parameters(self):
            return iter(self.tensors.items())

    held = {0: {}}
    for rank in range(tp):
        model = fake_sglang.tp_model(language, rank, tp)
        model.load_weights((name.replace("model.language_model.", "model."), t) for name, t in full.items()
                           if not name.startswith("model.visual."))
        held[0][rank] = module_checksums(model) | module_checksums(Held(tower))
    verify_checksums(expected.result(), held)

    held[0][tp - 1]["visual.blocks.1.attn.qkv_proj.bias"][2] += 1
    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank {tp - 1}: visual.blocks.1.attn.qkv_proj"):
        verify_checksums(expected.result(), held)
