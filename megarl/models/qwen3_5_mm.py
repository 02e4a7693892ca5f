"""Qwen3.5's published checkpoints (transformers' Qwen3_5ForConditionalGeneration, model_type qwen3_5, and
Qwen3_5MoeForConditionalGeneration, qwen3_5_moe: every Qwen3.5 release is one of them) trained as text-only policies
(text_only.py): the language model is qwen3_5.py's (dense) or qwen3_next.py's (MoE), and images are not used in
training (the rollouts are text; the vision tower takes no part in any forward).

- config.json: the language model's fields are its text_config (model_type qwen3_5_text / qwen3_5_moe_text), the
  top level's tie_word_embeddings deciding the head (megarl.utils.hf_config.language_fields). The text config's
  interleaved M-RoPE (mrope_section) is plain RoPE for text, whose three position ids are equal.
- tensors: the language model's are the text family's `model.*` under `model.language_model.*`, the head
  `lm_head.weight` (transformers 5.12's save_pretrained writes these names, its in-memory ones, and the published
  checkpoints have them); the tower's `model.visual.*` is not loaded: megarl.models.hf_checkpoint leaves it out with
  one logged line, every megarl checkpoint keeps the source's copy (bytes as read), and the export writes it back
  beside the trained language model, so the exported directory is the same ConditionalGeneration model again.
  The MoE's routed experts: the releases stack each layer's (`mlp.experts.gate_up_proj` [E, 2 x width, hidden],
  `mlp.experts.down_proj` [E, hidden, width]), transformers 5.12's save_pretrained writes one tensor per expert and
  projection (`mlp.experts.{e}.gate_proj.weight` ...); both are read (hf_checkpoint.PER_EXPERT_READ lists the
  stacked ones per expert), and megarl writes the per-expert names, which transformers and SGLang load as well. The
  multi-token-prediction tensors (`mtp.*`) are neither loaded nor written back, as for the text models.
- generation: SGLang serves the checkpoint as its own Qwen3_5(Moe)ForConditionalGeneration (models/qwen3_5.py
  there: the only entry classes it registers for Qwen3.5), whose loader takes `model.language_model.*` as its
  language model's `model.*`: the weight sync sends the language model under the checkpoint's names (the layout
  of megarl/rollout/sglang_layout.py, as for Qwen3-VL); the tower it loaded from the directory stays as it is.
  megarl starts that server as a text model (no image processor plugin).

Why not train on images: megarl's image path (qwen3_vl.py) builds Qwen3-VL's tower and DeepStack on a Qwen3 decoder
with interleaved M-RoPE over whole heads; Qwen3.5's tower has no DeepStack, its decoder is the hybrid one (the gated
delta nets would take image tokens, their sequence starts and M-RoPE positions through a model class of their own) and
RoPE covers a quarter of each head: a new model class and a tower to check against transformers, not a reuse. A
prompt with images for these checkpoints is refused when the data is read (megarl.data.inputs.image_prompts).
"""

from __future__ import annotations

from megarl.models.qwen3_5 import Qwen3_5
from megarl.models.qwen3_next import Qwen3Next
from megarl.models.text_only import TextOnlyPolicy


class Qwen3_5Multimodal(TextOnlyPolicy, Qwen3_5):
    name = "Qwen3.5 (vision-language checkpoint, text-only)"
    architectures = ("Qwen3_5ForConditionalGeneration", "qwen3_5")
    language_prefix = "model.language_model."


class Qwen3_5MoeMultimodal(TextOnlyPolicy, Qwen3Next):
    name = "Qwen3.5-MoE (vision-language checkpoint, text-only)"
    architectures = ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")
    language_prefix = "model.language_model."


FAMILY, MOE_FAMILY = Qwen3_5Multimodal(), Qwen3_5MoeMultimodal()
FAMILIES = (FAMILY, MOE_FAMILY)
