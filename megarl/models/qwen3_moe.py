"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM): Qwen3 attention (QK-norm, no biases) with a
mixture-of-experts MLP in every layer, on megatron's MoELayer with expert parallelism (EP).

Routing, as transformers computes it: p = softmax(router logits) over all experts (fp32), take the
top-k, and with norm_topk_prob divide them by their sum. megatron's TopKRouter gives the same numbers
as  - norm_topk_prob=true:  top-k of the logits, then softmax over those k (moe_router_pre_softmax=False);
      softmax is monotonic and a softmax over k entries is the renormalised slice of the full one;
    - norm_topk_prob=false: softmax over all experts, then top-k, no renormalisation (pre_softmax=True).
The load-balancing aux loss (router_aux_loss_coef) is off: transformers adds it only to the training
loss when output_router_logits is set and it never changes the logits, so the log-probs are compared
without it; RL fine-tuning runs without it too.
Tokens reach their experts through megatron's allgather dispatcher: the alltoall one creates CUDA
streams in its constructor and synchronises on them, so it cannot run on CPU/gloo.
Experts are split over TP like a dense MLP (megatron's expert TP size defaults to TP).
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.decoder import DecoderFamily
from megarl.models.sharding import WeightMap, fused_gate_up, replicated, split_dim


def _num_experts(hf: dict) -> int:
    # The published config.json files say num_experts; transformers >= 5 writes num_local_experts.
    return hf.get("num_experts") or hf["num_local_experts"]


class Qwen3Moe(DecoderFamily):
    name = "Qwen3-MoE"
    architectures = ("Qwen3MoeForCausalLM", "qwen3_moe")
    qk_norm = True

    def check_supported(self, hf: dict) -> None:
        super().check_supported(hf)
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ValueError("Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                             "supported: every layer must be a mixture of experts")

    def num_experts(self, hf: dict) -> int:
        return _num_experts(hf)

    def moe_config(self, hf: dict, ep: int) -> dict:
        experts = _num_experts(hf)
        if experts % ep:
            raise ValueError(f"EP={ep} must divide the number of experts ({experts})")
        return dict(num_moe_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_score_function="softmax",
                    moe_router_pre_softmax=not hf.get("norm_topk_prob", False), moe_router_dtype="fp32",
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                    moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)

    def layer_spec(self, hf: dict, layer: int) -> ModuleSpec:
        from megarl.parallel.compat import patch_moe_without_te

        patch_moe_without_te()
        return super().layer_spec(hf, layer)

    def mlp_maps(self, hf: dict, tp: int, layer: int) -> list[WeightMap]:
        """The router and every expert, named by GLOBAL expert index (each EP rank holds a slice)."""
        m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        maps = [WeightMap(m + "router.weight", (h + "gate.weight",), **replicated())]
        for e in range(_num_experts(hf)):
            me, he = m + f"experts.local_experts.{e}.", h + f"experts.{e}."
            maps += [WeightMap(me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"),
                               **fused_gate_up()),
                     WeightMap(me + "linear_fc2.weight", (he + "down_proj.weight",), **split_dim(1))]
        return maps


FAMILY = Qwen3Moe()
