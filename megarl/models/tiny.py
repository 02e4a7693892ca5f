"""A tiny Qwen2 model and character-level tokenizer, built offline for tests and CPU demos.

`build_tiny_model(out_dir)` writes an ordinary HF model directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) that `AutoTokenizer` and
`AutoModelForCausalLM` load with no network. The tokenizer maps each character to one token, so
the synthetic tasks in megarl.data.tasks are a few tokens long and a ~100k-parameter model can
learn them on a laptop.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
# Printable ASCII and newline: one token each. Other characters (e.g. accented letters) are not in
# the vocabulary and are dropped by the tokenizer, like any byte-level BPE missing their bytes.
CHARACTERS = "".join(chr(c) for c in range(32, 127)) + "\n"

_STAMP = "megarl_tiny.json"
_FORMAT_VERSION = 2  # bump when the files written below change, so stale directories are rebuilt


def build_char_tokenizer():
    """A character-level tokenizer: pad = 0, eos = 1, then one token per character of CHARACTERS.

    It is a Qwen2Tokenizer (byte-level BPE) with single-character tokens and no merges, because
    `AutoTokenizer` always rebuilds a qwen2 model's tokenizer as a Qwen2Tokenizer from the vocab;
    a vocab in byte-level form (space is "Ġ", newline "Ċ") makes that rebuild exact.
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for ch in CHARACTERS:
        vocab[byte_level.pre_tokenize_str(ch)[0][0]] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                          model_max_length=128)


def tiny_config(vocab_size: int, pad_id: int, eos_id: int, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, tie_embeddings: bool = True,
                intermediate_size: int | None = None):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=128, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        rms_norm_eps=1e-6, tie_word_embeddings=tie_embeddings, pad_token_id=pad_id, eos_token_id=eos_id,
        bos_token_id=None, architectures=["Qwen2ForCausalLM"])


def build_tiny_model(out_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, tie_embeddings: bool = True, seed: int = 0,
                     intermediate_size: int | None = None, vocab_multiple: int = 1) -> Path:
    """Write (or reuse) a randomly initialised tiny Qwen2ForCausalLM + char tokenizer in `out_dir`.

    `vocab_multiple`: embedding rows padded to a multiple of it past the tokenizer's, as real checkpoints do
    (SGLang's presharded loading of the embedding wants a vocabulary that is a multiple of 64 x TP).

    Idempotent: a directory already built with the same arguments is returned untouched. The
    files are written to a temporary sibling and renamed into place, so processes that build the
    same directory at once never see a half-written model.
    """
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    args = dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                tie_embeddings=tie_embeddings, seed=seed, intermediate_size=intermediate_size,
                format_version=_FORMAT_VERSION) | ({"vocab_multiple": vocab_multiple} if vocab_multiple != 1 else {})
    stamp = out_dir / _STAMP
    if stamp.exists():
        if json.loads(stamp.read_text()) == args:
            return out_dir
        raise FileExistsError(f"{out_dir} holds a tiny model built with {stamp.read_text()}, not {args}; "
                              f"remove it or choose another directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not a tiny-model directory (no {_STAMP})")

    tokenizer = build_char_tokenizer()
    vocab = -(-len(tokenizer) // vocab_multiple) * vocab_multiple
    config = tiny_config(vocab, tokenizer.pad_token_id, tokenizer.eos_token_id, hidden_size,
                         num_layers, num_heads, num_kv_heads, tie_embeddings, intermediate_size)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         do_sample=True).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(args))
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except OSError:
        if stamp.exists() and json.loads(stamp.read_text()) == args:
            return out_dir  # another process finished the same build first
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
