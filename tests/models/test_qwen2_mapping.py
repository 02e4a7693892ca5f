"""HF <-> megatron weight layout for Qwen2: registry, TP shard rules, config translation."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.models import get_family, qwen2
from megarl.models.sharding import fused_gate_up, fused_qkv, padded_vocab_size, vocab_rows


def _hf(**overrides):
    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"],
                         **overrides)
    return config.to_dict()


def test_registry_finds_qwen2_and_names_the_supported_ones():
    assert get_family(_hf()) is qwen2
    assert get_family({"model_type": "qwen2"}) is qwen2
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*supports.*Qwen2ForCausalLM"):
        get_family({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_qkv_layout_is_grouped_per_query_group_and_round_trips():
    heads, kv_heads, head_dim, hidden = 4, 2, 3, 5
    q = torch.arange(heads * head_dim * hidden, dtype=torch.float32).reshape(heads * head_dim, hidden)
    k = -torch.arange(kv_heads * head_dim * hidden, dtype=torch.float32).reshape(kv_heads * head_dim, hidden) - 1
    v = k - 1000
    rule = fused_qkv(heads, kv_heads, head_dim)
    fused = rule["to_shard"]([q, k, v], 0, 1)
    # group 0: query heads 0-1, key head 0, value head 0; then group 1.
    expected = torch.cat([q[:6], k[:3], v[:3], q[6:], k[3:], v[3:]])
    assert torch.equal(fused, expected)
    shards = [rule["to_shard"]([q, k, v], r, 2) for r in range(2)]
    assert torch.equal(shards[1], expected[12:])  # TP rank 1 holds query group 1 whole
    assert all(torch.equal(a, b) for a, b in zip(rule["from_shards"](shards), (q, k, v)))
    bias = [q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone()]
    assert all(torch.equal(a, b) for a, b in zip(rule["from_shards"]([rule["to_shard"](bias, r, 2) for r in range(2)]), bias))


def test_gate_up_shards_hold_their_gate_rows_then_their_up_rows():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    rule = fused_gate_up()
    shards = [rule["to_shard"]([gate, up], r, 2) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[3:], up[3:]]))
    assert all(torch.equal(a, b) for a, b in zip(rule["from_shards"](shards), (gate, up)))


def test_vocab_padding_is_zero_and_dropped_on_the_way_back():
    assert padded_vocab_size(101, 2) == 102 and padded_vocab_size(100, 4) == 100
    emb = torch.randn(101, 8)
    rule = vocab_rows(101, 2)
    shards = [rule["to_shard"]([emb], r, 2) for r in range(2)]
    assert shards[1].shape == (51, 8) and torch.equal(shards[1][-1], torch.zeros(8))
    assert torch.equal(rule["from_shards"](shards)[0], emb)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_maps_cover_every_hf_tensor_once(tied):
    hf = _hf(tie_word_embeddings=tied)
    hf_names = set(Qwen2ForCausalLM(Qwen2Config(**hf)).state_dict())
    if tied:
        hf_names.discard("lm_head.weight")  # the same tensor as the embedding; not saved
    exported = [n for m in qwen2.weight_maps(hf, 2) if m.export for n in m.hf]
    assert sorted(exported) == sorted(hf_names)
    output = [m for m in qwen2.weight_maps(hf, 2) if m.megatron == "output_layer.weight"][0]
    assert output.hf == (("model.embed_tokens.weight",) if tied else ("lm_head.weight",))


def test_transformer_config_translation_and_errors():
    hf = _hf(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-5)
    config = qwen2.transformer_config(hf, tp=2, pp=2, params_dtype=torch.float32, use_cpu_initialization=True)
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (2, 8, 48)
    assert config.add_qkv_bias and not config.add_bias_linear and config.gated_linear_unit
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == 1e-5
    kwargs = qwen2.gpt_model_kwargs(hf, tp=2)
    assert kwargs["vocab_size"] == 102 and kwargs["rotary_base"] == 1e6
    assert qwen2.gpt_model_kwargs({**hf, "rope_parameters": None, "rope_theta": 5e5}, 1)["rotary_base"] == 5e5
    with pytest.raises(ValueError, match="num_key_value_heads"):
        qwen2.transformer_config(hf, tp=4, pp=1, params_dtype=torch.float32, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="sliding"):
        qwen2.transformer_config({**hf, "use_sliding_window": True}, 1, 1, torch.float32, True)
