import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.models.tiny import CHARACTERS, build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_loads_offline_and_round_trips_text(tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert len(tok) == len(CHARACTERS) + 2 == model.config.vocab_size
    text = "abc dcba>12+345=357\nZ?"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))


def test_config_follows_arguments(tmp_path):
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=1,
                            tie_embeddings=False)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["tie_word_embeddings"], cfg["model_type"]) == (32, 3, 4, 1, False, "qwen2")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 has q/k/v biases
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_idempotent_and_seeded(tmp_path, tiny_dir):
    first = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_dir, seed=3) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == first  # reused, not rewritten
    with pytest.raises(FileExistsError, match="built with"):
        build_tiny_model(tiny_dir, seed=4)
    same = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "again", seed=3))
    other = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "other", seed=4))
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(same.state_dict()[w], ref.state_dict()[w])
    assert not torch.equal(other.state_dict()[w], ref.state_dict()[w])


def test_vocab_padded_to_a_multiple(tmp_path):
    from megarl.models.tiny import build_char_tokenizer

    padded = build_tiny_model(tmp_path / "padded", vocab_multiple=128)
    config = json.loads((padded / "config.json").read_text())
    assert len(build_char_tokenizer()) < 128 and config["vocab_size"] == 128
    assert build_tiny_model(tmp_path / "padded", vocab_multiple=128) == padded  # idempotent with the option
