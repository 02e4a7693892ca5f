"""A published vision-language checkpoint trained as a text-only policy: its language model is a text family's, read
under the checkpoint's own prefix, and its vision tower takes no part in any forward.

`TextOnlyPolicy` goes before the text family in a family's bases: every method the engine calls with the checkpoint's
config.json reads the language model's fields (megarl.utils.hf_config.language_fields) and hands them to the text
family, and the weight maps name the text family's `model.*` tensors under `language_prefix` (the head keeps its
name). What the checkpoint holds beyond the language model (megarl.utils.hf_config.TEXT_ONLY_TOWERS) is left out on
import, kept in every megarl checkpoint and written back by export (megarl.models.hf_checkpoint).
Families: gemma3_mm.py (Gemma 3), qwen3_5_mm.py (Qwen3.5, Qwen3.5-MoE).
"""

from __future__ import annotations

import dataclasses

from megarl.models.sharding import WeightMap
from megarl.utils.hf_config import language_fields


class TextOnlyPolicy:
    language_prefix = ""  # the checkpoint's name of the text family's `model.`

    def language_name(self, name: str) -> str:
        """The checkpoint's name of a language-model tensor the text family names `model.*` (others as they are)."""
        return self.language_prefix + name[len("model."):] if name.startswith("model.") else name

    def check_supported(self, hf: dict) -> None:
        super().check_supported(language_fields(hf))

    def transformer_config(self, hf: dict, *args, **kwargs):
        return super().transformer_config(language_fields(hf), *args, **kwargs)

    def gpt_model_kwargs(self, hf: dict, tp: int) -> dict:
        return super().gpt_model_kwargs(language_fields(hf), tp)

    def layer_spec(self, hf: dict, layer: int):
        return super().layer_spec(language_fields(hf), layer)

    def weight_maps(self, hf: dict, tp: int) -> list[WeightMap]:
        return [dataclasses.replace(m, hf=tuple(self.language_name(n) for n in m.hf))
                for m in super().weight_maps(language_fields(hf), tp)]
