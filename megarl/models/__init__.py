"""Model families, one module per architecture, looked up from a HF config.

A family module provides:
  transformer_config(hf, tp, pp, params_dtype, use_cpu_initialization) -> megatron TransformerConfig
  gpt_model_kwargs(hf, tp) -> keyword arguments of megatron's GPTModel (vocab, RoPE, tying)
  weight_maps(hf, tp) -> [WeightMap]: every megatron parameter, the HF tensors it is made of, and
                         how to cut its tensor-parallel shard from them and put the shards back
"""

from __future__ import annotations

import importlib
from types import ModuleType

# HF `architectures` entries and `model_type` values -> the module that implements the family.
_FAMILIES = {
    "Qwen2ForCausalLM": "megarl.models.qwen2",
    "qwen2": "megarl.models.qwen2",
}


def _get(hf_config, key: str):
    return hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)


def get_family(hf_config) -> ModuleType:
    """The family module for a HF config (a config.json dict or a transformers PretrainedConfig)."""
    candidates = list(_get(hf_config, "architectures") or []) + [_get(hf_config, "model_type")]
    for name in candidates:
        if name in _FAMILIES:
            return importlib.import_module(_FAMILIES[name])
    raise ValueError(f"unsupported model architecture {candidates}: megarl.models supports "
                     f"{', '.join(sorted(_FAMILIES))}")
