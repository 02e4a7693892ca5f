"""Mixtral (transformers' MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's attention (mistral.py: no biases, plain
RoPE, the sliding-window rule) with a sparse mixture of experts in every layer (moe.py: routing, dispatch, EP).

Routing, as transformers 5.12's MixtralTopKRouter computes it: softmax over all experts in fp32, top-k, the k
weights always divided by their sum (SGLang's FusedMoE: renormalize=True); moe.py's renormalised case.
router_jitter_noise (transformers multiplies the MoE input by uniform noise in training mode only) is refused
when not 0: megarl's forward has no such noise.
The checkpoint's names: model.layers.{i}.block_sparse_moe.gate.weight (the router) and
block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down). transformers 5 holds the experts fused in memory
(mlp.experts.gate_up_proj, mlp.experts.down_proj) and converts them from and to these names on load and save;
SGLang's MixtralForCausalLM loads these names (FusedMoE's expert mapping of w1/w3/w2). Each expert is
intermediate_size wide (Mixtral has no moe_intermediate_size: utils/hf_config.expert_width).
SGLang's MixtralAttention takes head_dim as hidden_size / num_attention_heads whatever the config says (the
published Mixtral models agree); transformers and megarl read an explicit head_dim.
"""

from __future__ import annotations

from megarl.models.mistral import check_sliding_window
from megarl.models.moe import SoftmaxTopKMoe


class Mixtral(SoftmaxTopKMoe):
    name = "Mixtral"
    architectures = ("MixtralForCausalLM", "mixtral")
    moe_module = "block_sparse_moe"
    expert_parts = ("w1", "w3", "w2")

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        check_sliding_window(hf, self.name)
        if hf.get("router_jitter_noise"):
            raise ValueError(f"Mixtral with router_jitter_noise={hf['router_jitter_noise']} is not supported: "
                             "megarl's forward adds no noise to the experts' input (set it to 0)")

    def renormalises(self, hf: dict) -> bool:
        return True


FAMILY = Mixtral()
