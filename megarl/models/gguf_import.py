"""A GGUF file (llama.cpp's format, quantized or not) -> a HF model directory that megarl, transformers and SGLang
load: float32 safetensors, config.json, generation_config.json, the tokenizer and its chat template.

transformers (with the `gguf` and `accelerate` packages) dequantizes the tensors and rebuilds the tokenizer. Its
import gets the special tokens wrong where the GGUF is right: transformers 5.12.1 makes SmolLM2's bos token
(<|im_start|>) its eos token as well and sets no pad token, while the GGUF's metadata names <|im_end|> for both
(the token a chat turn ends with). The special tokens are therefore taken from the GGUF's own metadata
(tokenizer.ggml.{bos,eos,padding}_token_id) into the tokenizer, config.json and generation_config.json alike, so that
every reader (megarl's tokenizer, the hf engine's stop tokens, SGLang's) agrees. Tied embeddings stay tied (the
saved file holds one copy; config.json says tie_word_embeddings).
"""

from __future__ import annotations

import shutil
from pathlib import Path

# GGUF metadata key -> the HF name of that special token
SPECIAL_TOKEN_KEYS = {"tokenizer.ggml.bos_token_id": "bos", "tokenizer.ggml.eos_token_id": "eos",
                      "tokenizer.ggml.padding_token_id": "pad"}


def special_token_ids(gguf_file: str | Path) -> dict[str, int]:
    """{bos, eos, pad: token id} as the GGUF's metadata names them (those it names)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_file)).fields
    return {name: int(fields[key].contents()) for key, name in SPECIAL_TOKEN_KEYS.items() if key in fields}


def gguf_to_hf(gguf_file: str | Path, out: str | Path) -> Path:
    """Write the HF directory `out` (new or empty) from `gguf_file`, through a staging directory beside it that is
    renamed when complete (a half-written directory is never at `out`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output {out} already exists and is not empty; choose a new path")
    special = special_token_ids(gguf_file)
    if "eos" not in special:
        raise ValueError(f"{gguf_file}: its metadata names no tokenizer.ggml.eos_token_id: responses could not end")
    special.setdefault("pad", special["eos"])  # as megarl.data.inputs.load_tokenizer pads: with the eos token
    source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    for name, token_id in special.items():
        setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))
        setattr(model.config, f"{name}_token_id", token_id)
    model.generation_config = GenerationConfig(**{f"{name}_token_id": i for name, i in special.items()})
    staging = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if out.exists():
        out.rmdir()  # empty (checked above)
    staging.rename(out)
    return out
