"""Model families, looked up from a HF config (megarl/models/decoder.py describes their interface).

Each family module defines FAMILY, a DecoderFamily whose `architectures` lists the HF `architectures`
entries and `model_type` values it serves (a module serving several defines FAMILIES, a tuple of them).
"""

from __future__ import annotations

import importlib

import torch

from megarl.models.decoder import DecoderFamily

_MODULES = ("megarl.models.qwen2", "megarl.models.llama", "megarl.models.qwen3", "megarl.models.qwen3_moe",
            "megarl.models.mistral", "megarl.models.mixtral", "megarl.models.deepseek", "megarl.models.qwen2_vl",
            "megarl.models.qwen3_vl", "megarl.models.qwen3_vl_moe", "megarl.models.qwen3_5", "megarl.models.qwen3_next",
            "megarl.models.glm4_moe", "megarl.models.gemma3", "megarl.models.gemma3_mm", "megarl.models.qwen3_5_mm",
            "megarl.models.gpt_oss")


def _get(hf_config, key: str):
    return hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)


def families() -> dict[str, DecoderFamily]:
    """Every supported HF architecture / model_type name -> its family."""
    table = {}
    for module in _MODULES:
        module = importlib.import_module(module)
        for family in getattr(module, "FAMILIES", (module.FAMILY,)):
            table.update({name: family for name in family.architectures})
    return table


def get_family(hf_config) -> DecoderFamily:
    """The family of a HF config (a config.json dict or a transformers PretrainedConfig)."""
    table = families()
    candidates = list(_get(hf_config, "architectures") or []) + [_get(hf_config, "model_type")]
    for name in candidates:
        if name in table:
            return table[name]
    raise ValueError(f"unsupported model architecture {candidates}: megarl.models supports "
                     f"{', '.join(sorted(table))}")


def checked_family(hf: dict, where: str) -> DecoderFamily:
    """The family of the config.json `hf` (read from `where`), after a dry build of its one-rank TransformerConfig
    and weight names: a key the family needs and the file lacks is an error naming both, not a KeyError deep in
    an engine."""
    try:
        family = get_family(hf)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    try:
        family.transformer_config(hf, tp=1, pp=1, params_dtype=torch.float32, use_cpu_initialization=True)
        family.weight_maps(hf, tp=1)
    except KeyError as e:
        raise ValueError(f"{where} has no {e.args[0]!r}, which a {family.name} model needs") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return family
