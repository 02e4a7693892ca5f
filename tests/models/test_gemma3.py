"""Gemma 3's weight names, config translation and refusals (megarl/models/gemma3.py); its numbers against transformers
are in test_families_vs_hf.py."""

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from safetensors.torch import load_file
from transformers import Gemma3ForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from megarl.engine.attention import resolve_core_attention
from megarl.models import get_family
from megarl.models.gemma3 import FAMILY as gemma3
from megarl.models.gemma3 import Gemma3MLP, Gemma3SelfAttention, WindowedAttention, gemma3_layer_types, window_mask
from megarl.reshard.inventory import hf_inventory
from tests.models.hf_families import gemma3_config

# google/gemma-3-1b-it's config.json as published (transformers 4.50 spelling: rope_local_base_freq,
# sliding_window_pattern, no tie_word_embeddings, which Gemma3TextConfig defaults to true), as recalled
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
             "sliding_window_pattern": 6, "vocab_size": 262144}


@pytest.mark.parametrize("tied", [True, False])
def test_weight_maps_and_inventory_are_the_checkpoint_tensors_once(tied, tmp_path):
    config = gemma3_config(tie_word_embeddings=tied)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    saved = load_file(f"{tmp_path}/model.safetensors")
    hf = config.to_dict()
    assert get_family(hf) is gemma3 and get_family({"model_type": "gemma3_text"}) is gemma3
    maps = gemma3.weight_maps(hf, 2)
    assert sorted(n for m in maps if m.export for n in m.hf) == sorted(saved)
    assert len({m.megatron for m in maps}) == len(maps)
    assert {s.name: s.shape for s in hf_inventory(hf)} == {name: tuple(t.shape) for name, t in saved.items()}


def test_published_1b_config_translates():
    """The 1B's config.json (old spelling): five local layers then a global one, windows of 512 on the local layers'
    core attention, RoPE bases 1e4 / 1e6 without scaling, 1 / 16 softmax scale, the head tied to the embedding."""
    kinds = gemma3_layer_types(GEMMA3_1B)
    assert kinds[:6] == ["sliding_attention"] * 5 + ["full_attention"] and kinds.count("full_attention") == 4
    config = gemma3.transformer_config(GEMMA3_1B, tp=1, pp=1, params_dtype=torch.float32,
                                       use_cpu_initialization=True)
    assert config.softmax_scale == 256 ** -0.5 and config.layernorm_zero_centered_gamma and config.qk_layernorm
    assert config.activation_func(torch.tensor([1.0])).item() == pytest.approx(0.8411920, abs=1e-6)  # gelu tanh
    kwargs = gemma3.gpt_model_kwargs(GEMMA3_1B, tp=1)
    assert kwargs["share_embeddings_and_output_weights"] and kwargs["rotary_base"] == 1e6
    assert kwargs["local_rotary_base"] == 1e4 and "seq_len_interpolation_factor" not in kwargs
    for layer in (0, 5):
        spec = gemma3.layer_spec(GEMMA3_1B, layer)
        attention = spec.submodules.self_attention
        assert attention.module is Gemma3SelfAttention and spec.submodules.mlp is Gemma3MLP
        assert attention.params["sliding"] == (layer == 0)
        core = attention.submodules.core_attention
        assert (getattr(core, "module", core), getattr(core, "params", None)) == (
            (WindowedAttention, {"window": 512}) if layer == 0 else (DotProductAttention, None))
    assert [m.megatron for m in gemma3.weight_maps(GEMMA3_1B, 1)][-1] == "output_layer.weight"
    assert {s.name for s in hf_inventory(GEMMA3_1B)} >= {"model.layers.0.pre_feedforward_layernorm.weight"}
    assert "lm_head.weight" not in {s.name for s in hf_inventory(GEMMA3_1B)}


def test_rope_tables_are_transformers_per_layer_type():
    """The 4B's linearly scaled global RoPE (factor 8) and the local base, from both config spellings, give
    transformers' frequencies: megatron's table (positions / factor) and the local one."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    old = dict(GEMMA3_1B, head_dim=16, rope_scaling={"rope_type": "linear", "factor": 8.0})
    new = gemma3_config().to_dict()
    for hf in (old, new):
        kwargs = gemma3.gpt_model_kwargs(hf, tp=1)
        assert kwargs["seq_len_interpolation_factor"] == 8.0
        ours = {"full_attention": RotaryEmbedding(16, 1.0, seq_len_interpolation_factor=8.0,
                                                  rotary_base=kwargs["rotary_base"], use_cpu_initialization=True),
                "sliding_attention": RotaryEmbedding(16, 1.0, rotary_base=kwargs["local_rotary_base"],
                                                     use_cpu_initialization=True)}
        reference = Gemma3RotaryEmbedding(gemma3_config())
        positions = torch.arange(40)[None]
        for kind, rotary in ours.items():
            cos, _ = reference(torch.zeros(1, dtype=torch.float32), positions, kind)
            freqs = rotary.get_freqs_non_repeated(40)  # what forward concatenates twice, here without a GPU
            torch.testing.assert_close(torch.cat([freqs, freqs], -1).cos(), cos[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides, error", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"sliding_window": None}, "sliding_window=null"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "global RoPE scaling 'yarn'"),
])
def test_unsupported_settings_are_refused_by_key(overrides, error):
    with pytest.raises(ValueError, match=error):
        gemma3.transformer_config(GEMMA3_1B | overrides, tp=1, pp=1, params_dtype=torch.float32,
                                  use_cpu_initialization=True)


def test_attention_other_than_local_is_refused_and_auto_is_local():
    assert resolve_core_attention("auto", "cuda", 1, gemma3.name) == "local"
    for name, cp in (("sdpa", 1), ("varlen", 1), ("auto", 2)):
        with pytest.raises(ValueError, match="actor.attention.*Gemma 3.*sliding windows"):
            resolve_core_attention(name, "cuda", cp, gemma3.name)


def test_window_mask_keeps_a_window_of_keys_within_the_given_mask():
    """Query i sees keys i - window + 1 .. i (transformers' sliding_window_overlay), and nothing the mask hides."""
    causal = window_mask(None, 6, 3, "cpu")
    assert sorted(map(tuple, (~causal[0, 0]).nonzero().tolist())) == [
        (i, j) for i in range(6) for j in range(max(0, i - 2), i + 1)]
    packed = torch.ones(6, 6, dtype=torch.bool).triu(1)
    packed[3:, :3] = True  # a second sequence from position 3
    masked = window_mask(packed[None, None], 6, 3, "cpu")
    assert sorted(map(tuple, (~masked[0, 0]).nonzero().tolist())) == [
        (i, j) for i in range(6) for j in range(max(0 if i < 3 else 3, i - 2), i + 1)]


def test_planner_prices_gemma3_27b_and_4b(capsys):
    """Published totals of the language models (27.01B, 3.88B); the stored attention scores in the activations; the
    embedding whole on every SGLang rank; the CLI says which attention it assumed."""
    from megarl.reshard.layout import GenLayout
    from megarl.reshard.memory import MemorySettings, rank_memory
    from megarl.reshard.plan import generation_bytes, load_model_config, main, train_layout

    for name, billions in (("gemma-3-27b", 27.01), ("gemma-3-4b", 3.88)):
        assert sum(s.numel for s in hf_inventory(load_model_config(name))) / 1e9 == pytest.approx(billions, rel=2e-3)
    hf = load_model_config("gemma-3-27b")
    train = train_layout(hf, {"tp": 8, "pp": 1, "dp": 1, "ep": 1, "etp": 8, "cp": 1})
    settings = MemorySettings(seq_len=4096, micro_batch=1, micro_batches=1)
    with_scores = rank_memory(hf, train, 0, settings)["activations"]
    without = rank_memory(dict(hf, model_type="llama"), train, 0, settings)["activations"]
    scores = 62 * (4 + 2) * 4096 * 4096 * 32 / 8  # fp32 softmax output + bf16 probabilities, per layer
    norms = 62 * 2 * 2 * 2 * 5376 * 4096 / 8  # two more norms' bf16 inputs and outputs (sequence parallel)
    assert with_scores - without == pytest.approx(scores + norms - 62 * 4 * 4096 * 32 / 8, rel=1e-9)
    specs = hf_inventory(hf)
    embedding = 262208 * 5376 * 2
    for rank in range(8):
        assert generation_bytes(specs, GenLayout(8), rank) > embedding
    main(["--model", "gemma-3-27b", "--train", "tp=8,pp=2,dp=1", "--gen", "tp=8"])
    out = capsys.readouterr().out
    assert out.startswith("gemma-3-27b: 27.01B parameters") and "attention is megatron's unfused one" in out


def test_sglang_holds_the_embedding_whole_and_fuses_qkv_and_gate_up():
    """SGLang's Gemma3ForCausalLM (gemma3_causal.py load_weights): qkv_proj, gate_up_proj, the norms as named, the
    embedding whole on every rank and no lm_head (tied), also for sharded delivery."""
    from megarl.rollout.sglang_layout import SGLangLayout, check_presharded_vocab

    hf = gemma3_config(vocab_size=100).to_dict()
    specs = hf_inventory(hf)
    layout = SGLangLayout(specs, tp=2, hf=hf)
    check_presharded_vocab(specs, 2)
    for rank in range(2):
        assert layout.rows("model.embed_tokens.weight", rank) == (0, 100)
        assert layout.rows("model.layers.0.self_attn.q_proj.weight", rank) == (rank * 32, (rank + 1) * 32)
        names = layout.parameters(rank)
        assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names
        assert {n for n in names if n.startswith("model.layers.0.")} == {
            f"model.layers.0.{n}" for n in (
                "input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                "self_attn.q_norm.weight", "self_attn.k_norm.weight", "post_attention_layernorm.weight",
                "pre_feedforward_layernorm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                "post_feedforward_layernorm.weight")}
