"""Mixture-of-experts families routed by a softmax over all experts and a top-k (Qwen3-MoE, Mixtral), on megatron's
MoELayer with expert parallelism (EP); a family subclasses SoftmaxTopKMoe and says where its checkpoint keeps the
experts and whether it renormalises the chosen weights (megarl/utils/hf_config.py reads how many and how wide).

Routing, as transformers computes it: p = softmax(router logits) over all experts (fp32), take the top-k, and
where the family renormalises divide them by their sum. megatron's TopKRouter gives the same numbers as
  - renormalised:      top-k of the logits, then softmax over those k (moe_router_pre_softmax=False);
                       softmax is monotonic and a softmax over k entries is the renormalised slice of the full one;
  - not renormalised:  softmax over all experts, then top-k, no renormalisation (pre_softmax=True).
The load-balancing aux loss (router_aux_loss_coef) is off: transformers adds it only to the training loss when
output_router_logits is set and it never changes the logits, so the log-probs are compared without it; RL
fine-tuning runs without it too.
Tokens reach their experts through megatron's allgather dispatcher: the alltoall one creates CUDA streams in its
constructor and synchronises on them, so it cannot run on CPU/gloo.
Experts are split over TP like a dense MLP (megatron's expert TP size defaults to TP).
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.decoder import DecoderFamily
from megarl.models.sharding import GATE_UP_DOWN, WeightMap, gated_mlp, replicated
from megarl.utils.hf_config import expert_width, routed_experts


class SoftmaxTopKMoe(DecoderFamily):
    moe_module = "mlp"            # the layer's MoE block in the checkpoint: <moe_module>.gate, <moe_module>.experts.{e}
    expert_parts = GATE_UP_DOWN   # an expert's gate, up and down projections in the checkpoint

    def renormalises(self, hf: dict) -> bool:
        raise NotImplementedError

    def num_experts(self, hf: dict) -> int:
        return routed_experts(hf)

    def moe_config(self, hf: dict, ep: int) -> dict:
        experts = self.num_experts(hf)
        if experts % ep:
            raise ValueError(f"EP={ep} must divide the number of experts ({experts})")
        return dict(num_moe_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                    moe_ffn_hidden_size=expert_width(hf)[0], moe_router_score_function="softmax",
                    moe_router_pre_softmax=not self.renormalises(hf), moe_router_dtype="fp32",
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                    moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        from megarl.parallel.compat import patch_moe_without_te

        patch_moe_without_te()
        return super().layer_spec(hf, layer)

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        """The router and every expert, named by GLOBAL expert index (each EP rank holds a slice)."""
        m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.{self.moe_module}."
        maps = [WeightMap(m + "router.weight", (h + "gate.weight",), **replicated())]
        for e in range(self.num_experts(hf)):
            maps += gated_mlp(m + f"experts.local_experts.{e}.", h + f"experts.{e}.", self.expert_parts)
        return maps
