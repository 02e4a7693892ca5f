"""GLM-4.5 (transformers' Glm4MoeForCausalLM, model_type glm4_moe: GLM-4.5 355B-A32B, GLM-4.5-Air 106B-A12B, and
GLM-4.6, which has the same architecture): grouped-query attention with q/k/v biases where attention_bias is set and
a per-head RMSNorm of queries and keys where use_qk_norm is set (GLM-4.5 has both, Air the biases only); RoPE on part
of each head; the first first_k_dense_replace layers with a dense SwiGLU MLP, the rest with DeepSeek-V3's mixture of
experts (deepseek_moe.py, router.py: sigmoid scores, e_score_correction_bias for the choice only, the group-limited
top-k over n_group groups scored by their top-2 sum, norm_topk_prob, routed_scaling_factor, n_shared_experts shared
experts of moe_intermediate_size each). transformers routes glm4_moe by groups whatever n_group is (the published
models: n_group = topk_group = 1, one group of every expert), so routing_rule's noaux_tc case is its rule exactly.

Partial RoPE, as transformers 5.12 computes it (Glm4MoeRotaryEmbedding; apply_rotary_pos_emb of gpt_neox): the first
int(head_dim x partial_rotary_factor) channels of each query and key head rotate by the rotate-half rule (channel i
paired with i + rotary_dim / 2, not interleaved pairs), frequencies rope_theta^(-2i / rotary_dim); the rest pass
through unchanged. megatron's RotaryEmbedding with rotary_percent = partial_rotary_factor computes the same (its dim is
int(kv_channels x rotary_percent), not interleaved, t[..., dim:] passed through), as SGLang's get_rope with that
partial_rotary_factor (neox style) does, so q/k load unpermuted. partial_rotary_factor is read from rope_parameters,
else the top level of config.json (the published files), else transformers' default 0.5. GLM-4's dense model (Glm)
rotates interleaved pairs instead; it is not this family.

The multi-token-prediction layer (num_nextn_predict_layers = 1 in the published models: model.layers.92.* of GLM-4.5,
model.layers.46.* of Air) is not built: RL does not train it. Import leaves its tensors out with one logged line, and
megarl's checkpoints keep the source's copy and export writes it back (hf_checkpoint.py), as for DeepSeek-V3.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.decoder import DecoderFamily
from megarl.models.deepseek import DenseThenMoe


class Glm4Moe(DenseThenMoe, DecoderFamily):
    name = "GLM-4.5"
    architectures = ("Glm4MoeForCausalLM", "glm4_moe")
    partial_rotary_factor = 0.5  # transformers' Glm4MoeConfig default

    def has_qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get("attention_bias"))

    def has_qk_norm(self, hf: dict) -> bool:
        return bool(hf.get("use_qk_norm"))

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        return self.with_moe_mlp(super().layer_spec(hf, layer), hf, layer)


FAMILY = Glm4Moe()
