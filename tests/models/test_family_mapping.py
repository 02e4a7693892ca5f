"""HF <-> megatron weight layout and config translation of the model families: registry, TP shard
rules, per-family features (Qwen2 biases, Llama 3 RoPE scaling, Qwen3 QK-norm, Qwen3-MoE experts, Mistral's head_dim
and sliding window, Mixtral's experts, GLM-4.5's attention, partial RoPE and routing)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.models import get_family
from megarl.models.glm4_moe import FAMILY as glm4_moe
from megarl.models.llama import FAMILY as llama
from megarl.models.mistral import FAMILY as mistral
from megarl.models.mixtral import FAMILY as mixtral
from megarl.models.qwen2 import FAMILY as qwen2
from megarl.models.qwen3 import FAMILY as qwen3
from megarl.models.qwen3_moe import FAMILY as qwen3_moe
from megarl.models.sharding import fused_gate_up, fused_qkv, padded_vocab_size, vocab_rows
from megarl.reshard.inventory import hf_inventory
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import (MODEL_CLASSES, glm4_moe_config, llama_config, mistral_config, mixtral_config,
                                      qwen3_config, qwen3_moe_config, save_random)


def _hf(**overrides):
    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"],
                         **overrides)
    return config.to_dict()


def test_registry_finds_qwen2_and_names_the_supported_ones():
    assert get_family(_hf()) is qwen2
    assert get_family({"model_type": "qwen2"}) is qwen2
    with pytest.raises(ValueError, match=r"GemmaForCausalLM.*supports.*Qwen2ForCausalLM"):
        get_family({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})


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



def test_registry_finds_every_family_by_architecture_or_model_type():
    for config, family in ((llama_config(True), llama), (qwen3_config(True), qwen3),
                           (qwen3_moe_config(True, True), qwen3_moe), (mistral_config(), mistral),
                           (mixtral_config(), mixtral), (glm4_moe_config(), glm4_moe)):
        hf = config.to_dict()
        assert get_family(hf) is family and get_family(config) is family
        assert get_family({"model_type": hf["model_type"]}) is family


@pytest.mark.parametrize("make", [lambda t: llama_config(t), lambda t: qwen3_config(t),
                                  lambda t: qwen3_moe_config(t, True), lambda t: mistral_config(tie_word_embeddings=t),
                                  lambda t: mixtral_config(tie_word_embeddings=t),
                                  lambda t: glm4_moe_config(tie_word_embeddings=t),
                                  lambda t: glm4_moe_config(tie_word_embeddings=t, use_qk_norm=False,
                                                            attention_bias=False)])
@pytest.mark.parametrize("tied", [True, False])
def test_weight_maps_of_every_family_cover_every_checkpoint_tensor_once(make, tied, tmp_path):
    """The family's HF names, and the resharder's inventory (from config.json alone, with each tensor's shape), are
    the checkpoint's as transformers writes it (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2, not the fused
    tensors transformers 5 holds in memory)."""
    config = make(tied)
    family = get_family(config.to_dict())
    MODEL_CLASSES[config.architectures[0]](config).save_pretrained(tmp_path)
    saved = load_file(f"{tmp_path}/model.safetensors")  # the per-expert names of the checkpoint files
    exported = [n for m in family.weight_maps(config.to_dict(), 2) if m.export for n in m.hf]
    assert sorted(exported) == sorted(saved)
    inventory = {s.name: s.shape for s in hf_inventory(config.to_dict())}
    assert inventory == {name: tuple(t.shape) for name, t in saved.items()}


def assert_names_and_tp2_shards(family, hf: dict, saved: dict) -> None:
    """The family's TP=2 weight maps name every checkpoint tensor once, the resharder's inventory gives each one's
    shape, and every map's two shards assemble back into its tensors bitwise."""
    maps = family.weight_maps(hf, 2)
    assert sorted(n for m in maps if m.export for n in m.hf) == sorted(saved)
    assert {s.name: s.shape for s in hf_inventory(hf)} == {n: tuple(t.shape) for n, t in saved.items()}
    for m in maps:
        tensors = [saved[n] for n in m.hf]
        back = m.from_shards([m.to_shard(tensors, rank, 2) for rank in range(2)])
        assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True)), m.megatron


def test_llama3_rope_scaling_equals_transformers_frequencies():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(tied=False)
    kwargs = llama.gpt_model_kwargs(config.to_dict(), tp=1)
    assert kwargs["rope_scaling"] and kwargs["rope_scaling_factor"] == 8.0 and kwargs["rotary_base"] == 5e5
    ours = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=kwargs["rotary_base"], rope_scaling=True,
                           rope_scaling_factor=kwargs["rope_scaling_factor"], use_cpu_initialization=True).inv_freq
    plain = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=5e5, use_cpu_initialization=True).inv_freq
    torch.testing.assert_close(ours, LlamaRotaryEmbedding(config).inv_freq, rtol=1e-6, atol=0)
    # kept (high frequencies), smoothed, divided by the factor (the lowest frequency)
    assert ours[0] == plain[0] and plain[2] / 8 < ours[2] < plain[2] and ours[3] == plain[3] / 8
    # the published Llama 3.1 config.json spelling
    old_style = {**config.to_dict(), "rope_parameters": None, "rope_theta": 5e5,
                 "rope_scaling": {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}}
    assert llama.gpt_model_kwargs(old_style, 1) == kwargs
    other = {**config.to_dict(), "rope_parameters": {**config.rope_parameters, "high_freq_factor": 2.0}}
    with pytest.raises(ValueError, match="high_freq_factor"):
        llama.gpt_model_kwargs(other, 1)
    with pytest.raises(ValueError, match="yarn"):
        llama.gpt_model_kwargs({**config.to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 1)


def test_qwen3_qk_norm_and_qwen3_moe_router_translation():
    config = qwen3.transformer_config(qwen3_config(True).to_dict(), 2, 1, torch.float32, True)
    assert config.qk_layernorm and not config.add_qkv_bias and config.kv_channels == 16
    assert config.num_moe_experts is None
    for norm_topk_prob in (True, False):
        hf = qwen3_moe_config(False, norm_topk_prob).to_dict()
        config = qwen3_moe.transformer_config(hf, 1, 1, torch.float32, True, ep=2)
        assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 16)
        # norm_topk_prob: top-k then softmax over those k; otherwise softmax over all, then top-k.
        assert config.moe_router_pre_softmax is not norm_topk_prob
        assert config.moe_aux_loss_coeff == 0 and config.moe_router_load_balancing_type == "none"
        assert config.expert_model_parallel_size == 2 and config.qk_layernorm
    with pytest.raises(ValueError, match="EP=3 must divide"):
        qwen3_moe.transformer_config(hf, 1, 1, torch.float32, True, ep=3)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        qwen3_moe.transformer_config({**hf, "mlp_only_layers": [0]}, 1, 1, torch.float32, True)
    with pytest.raises(ValueError, match="dense"):
        qwen3.transformer_config(qwen3_config(True).to_dict(), 1, 1, torch.float32, True, ep=2)


def test_mistral_head_dim_and_sliding_window():
    """An explicit head_dim (Mistral-Nemo's 128 with hidden 5120 / 32 heads) is the attention's kv_channels; a
    sliding window shorter than max_position_embeddings is refused by key."""
    hf = mistral_config().to_dict()
    config = mistral.transformer_config(hf, 2, 1, torch.float32, True)
    assert (config.kv_channels, config.hidden_size, config.num_query_groups) == (12, 32, 2)
    assert not config.add_qkv_bias and not config.add_bias_linear and config.num_moe_experts is None
    assert mistral.gpt_model_kwargs(hf, 2)["rotary_base"] == 2e5
    nemo = {**hf, "hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert mistral.transformer_config(nemo, 1, 1, torch.float32, True).kv_channels == 128
    for window in (None, 12, 4096):
        mistral.transformer_config({**hf, "sliding_window": window}, 1, 1, torch.float32, True)
    for family in (mistral, mixtral):
        config_hf = {**(hf if family is mistral else mixtral_config().to_dict()), "max_position_embeddings": 12}
        with pytest.raises(ValueError, match=r"sliding_window=11 < max_position_embeddings=12"):
            family.transformer_config({**config_hf, "sliding_window": 11}, 1, 1, torch.float32, True)


def test_mistral_sliding_window_shorter_than_a_row_changes_transformers_logprobs(tmp_path):
    """Why the refusal: a window of 10 leaves the first token out of the last prediction of padded_batch's 12-token
    row (its logits at position 10 see positions 1..10), and transformers' log-prob there differs from full
    attention's; every earlier one is the same."""
    full = hf_logprobs_entropy(save_random(mistral_config(), tmp_path / "w12"), padded_batch())[0]
    short = hf_logprobs_entropy(save_random(mistral_config(sliding_window=10), tmp_path / "w10"), padded_batch())[0]
    assert torch.equal(full[:, :11], short[:, :11]) and not torch.equal(full[0, 11], short[0, 11])


def test_mixtral_router_and_expert_translation():
    hf = mixtral_config().to_dict()
    config = mixtral.transformer_config(hf, 1, 1, torch.float32, True, ep=2)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 24)
    # transformers' MixtralTopKRouter always renormalises the top-k weights: top-k of the logits, softmax over those k
    assert not config.moe_router_pre_softmax and config.moe_router_score_function == "softmax"
    assert config.moe_aux_loss_coeff == 0 and config.moe_router_load_balancing_type == "none"
    assert config.expert_model_parallel_size == 2 and not config.qk_layernorm
    maps = {m.megatron: m.hf for m in mixtral.weight_maps(hf, 1)}
    p = "model.layers.1.block_sparse_moe."
    assert maps["decoder.layers.1.mlp.router.weight"] == (p + "gate.weight",)
    assert maps["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == (p + "experts.3.w1.weight",
                                                                                       p + "experts.3.w3.weight")
    assert maps["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"] == (p + "experts.3.w2.weight",)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        mixtral.transformer_config({**hf, "router_jitter_noise": 0.01}, 1, 1, torch.float32, True)
    with pytest.raises(ValueError, match="EP=3 must divide"):
        mixtral.transformer_config(hf, 1, 1, torch.float32, True, ep=3)


def test_glm4_moe_attention_rope_and_router_translation():
    """GLM-4.5's q/k/v biases and QK-norm follow attention_bias and use_qk_norm (Air: biases only); RoPE covers
    partial_rotary_factor of each head, read from rope_parameters, else the top level (the published config.json),
    else transformers' 0.5; the first first_k_dense_replace layers are dense, the rest DeepSeek-V3's sigmoid routing
    with its bias, groups, scaling and shared expert."""
    hf = glm4_moe_config().to_dict()
    config = glm4_moe.transformer_config(hf, 2, 1, torch.float32, True, ep=2)
    assert config.add_qkv_bias and config.qk_layernorm and not config.add_bias_linear
    assert (config.kv_channels, config.hidden_size, config.ffn_hidden_size) == (12, 40, 56)
    assert config.moe_layer_freq == [0, 1] and config.moe_router_score_function == "sigmoid"
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.moe_shared_expert_intermediate_size) == (8, 3, 20, 20)
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5 and config.expert_model_parallel_size == 2
    router = glm4_moe.layer_spec(hf, 1).submodules.mlp.submodules.router
    assert router.func.__name__ == "DeepSeekRouter" and router.keywords["rule"].score_bias
    assert glm4_moe.layer_spec(hf, 0).submodules.mlp.module.__name__ == "MLP"
    maps = {m.megatron: m.hf for m in glm4_moe.weight_maps(hf, 1)}
    p = "model.layers.1.mlp."
    assert maps["decoder.layers.1.mlp.router.expert_bias"] == (p + "gate.e_score_correction_bias",)
    assert maps["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (p + "shared_experts.gate_proj.weight",
                                                                            p + "shared_experts.up_proj.weight")
    assert maps["decoder.layers.1.self_attention.linear_qkv.bias"] == tuple(
        f"model.layers.1.self_attn.{x}_proj.bias" for x in "qkv")
    assert maps["decoder.layers.0.self_attention.q_layernorm.weight"] == ("model.layers.0.self_attn.q_norm.weight",)

    air = {**hf, "use_qk_norm": False}
    assert not glm4_moe.transformer_config(air, 1, 1, torch.float32, True).qk_layernorm
    assert not any("layernorm" in m.megatron for m in glm4_moe.weight_maps(air, 1) if "self_attention" in m.megatron)
    unbiased = {**hf, "attention_bias": False}
    assert not glm4_moe.transformer_config(unbiased, 1, 1, torch.float32, True).add_qkv_bias
    assert not any(m.megatron.endswith("linear_qkv.bias") for m in glm4_moe.weight_maps(unbiased, 1))

    assert glm4_moe.gpt_model_kwargs(hf, 1)["rotary_percent"] == 0.5
    published = {k: v for k, v in hf.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    published |= {"rope_theta": 1e6, "rope_scaling": None}
    for extra, fraction in (({"partial_rotary_factor": 0.25}, 0.25), ({}, 0.5)):
        kwargs = glm4_moe.gpt_model_kwargs(published | extra, 1)
        assert (kwargs["rotary_percent"], kwargs["rotary_base"]) == (fraction, 1e6)
    yarn = {**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(ValueError, match="RoPE scaling 'yarn'"):
        glm4_moe.gpt_model_kwargs(yarn, 1)
    with pytest.raises(ValueError, match="n_shared_experts=0"):
        glm4_moe.transformer_config({**hf, "n_shared_experts": 0}, 1, 1, torch.float32, True)
    with pytest.raises(ValueError, match="n_group=3"):
        glm4_moe.transformer_config({**hf, "n_group": 3}, 1, 1, torch.float32, True)
