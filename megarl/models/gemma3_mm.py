"""Gemma 3's multimodal checkpoints (transformers' Gemma3ForConditionalGeneration, model_type gemma3: google/gemma-3-4b,
-12b, -27b, pretrained and -it) trained as text-only policies (text_only.py): the language model is gemma3.py's, and
images are not used in training (the rollouts are text; the vision tower and its projector take no part in any forward).

- config.json: the language model's fields are its text_config over Gemma3TextConfig's defaults (the published
  files leave most of them out: megarl.utils.hf_config.language_fields); the top level's tie_word_embeddings ties the
  head, true unless it says otherwise (untied is refused by key: transformers would name that head
  language_model.lm_head, which no published checkpoint has).
- tensors: the language model's are the text family's `model.*` under `language_model.model.*` (transformers' names
  on disk, 4.50 to 5.12; it saves them so, and the published checkpoints have them; a checkpoint stored under its
  in-memory names, model.language_model.*, is read under these: hf_checkpoint.IN_MEMORY_PREFIXES); the SigLIP tower's
  `vision_tower.*` and the projector's `multi_modal_projector.*` are not loaded: megarl.models.hf_checkpoint leaves
  them out with one logged line, every megarl checkpoint keeps the source's copy of them (bytes as read), and the
  export writes them back beside the trained language model, so the exported directory is a Gemma3ForConditional
  Generation again (its config.json as it was, the original tower bitwise).
- generation: SGLang serves the checkpoint as its own Gemma3ForConditionalGeneration (models/gemma3_mm.py there),
  whose language model's parameters are `language_model.model.*`: the weight sync sends the language model under the
  checkpoint's names, which that loader takes (q/k/v and gate/up fused as in its Gemma3ForCausalLM); the tower it
  loaded from the directory stays as it is. megarl starts that server as a text model (no image processor plugin).

Why not train on images: megarl's image path (qwen2_vl.py) places a tower's features at the placeholder tokens of a
causal decoder; Gemma 3 also attends bidirectionally among each image's tokens (a mask per image, which megarl's
packed attention does not build), and its SigLIP tower and pooling projector would be a third tower to build and
check against transformers. Text-only RL is what the checkpoint's language model needs here.
"""

from __future__ import annotations

from megarl.models.gemma3 import Gemma3
from megarl.models.text_only import TextOnlyPolicy
from megarl.utils.hf_config import language_fields


class Gemma3Multimodal(TextOnlyPolicy, Gemma3):
    name = "Gemma 3 (multimodal checkpoint, text-only)"
    architectures = ("Gemma3ForConditionalGeneration", "gemma3")
    language_prefix = "language_model.model."

    def check_supported(self, hf: dict) -> None:
        if not language_fields(hf).get("tie_word_embeddings", True):
            raise ValueError("Gemma3ForConditionalGeneration with tie_word_embeddings=false is not supported (every "
                             "published one ties its head to the embedding)")
        super().check_supported(hf)


FAMILY = Gemma3Multimodal()
