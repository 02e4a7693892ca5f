"""One TP rank of SGLang 0.5.17's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, or Glm4MoeForCausalLM (GLM-4.5: the
same MoE layers and loading, grouped-query attention instead of MLA), as it holds and loads weights (bf16, no
quantization; --ep-size with no all-to-all backend and the trivial expert location), written here from SGLang's
source, not from megarl's layout: models/deepseek_v2.py and models/glm4_moe.py (the modules and their parameters),
deepseek_common/deepseek_weight_loader.py (do_load_weights, post_load_weights), layers/linear.py,
layers/moe/fused_moe_triton/layer.py (_load_w13, _load_w2, weight_loader) and layers/vocab_parallel_embedding.py.

Expert parallelism (`ep`, SGLang's --ep-size): distributed/parallel_state.py builds the MoE EP groups as
range(start, start + ep * moe_tp, moe_tp) and the MoE TP groups as runs of moe_tp = tp / ep consecutive ranks, so
TP rank r is MoE EP rank r // moe_tp and MoE TP rank r % moe_tp. FusedMoE.__init__ then holds num_local_experts =
n_routed_experts / ep experts, each intermediate_size / moe_tp wide; weight_loader (through
ExpertLocationMetadata.init_trivial: physical expert = logical expert) keeps expert e at local index
e - ep_rank * num_local_experts when _map_global_expert_id_to_local_expert_id finds it in the rank's block and
drops it otherwise; _load_w13/_load_w2 narrow by the MoE TP rank. DeepseekV2MoE keeps the router and the shared
experts TP-cut over all TP ranks, and determine_num_fused_shared_experts fuses no shared expert under expert
parallelism on NVIDIA GPUs.

- Parameters: embed_tokens / lm_head rows of the vocabulary padded to a multiple of 64 (padding rows zero);
  per layer the norms; GLM-4.5's attention: qkv_proj (QKVParallelLinear: the rank's query heads, then its key and
  value heads, a K/V head replicated on tp / kv ranks above their count; its bias likewise where attention_bias),
  o_proj row-parallel, q_norm/k_norm whole where use_qk_norm; MLA: fused_qkv_a_proj_with_mqa (q_a_proj rows then
  kv_a_proj_with_mqa's, replicated) with q_a_layernorm and q_b_proj, or q_proj and kv_a_proj_with_mqa without
  q_lora_rank; kv_a_layernorm; kv_b_proj and q_b_proj/q_proj column-parallel, o_proj row-parallel; dense MLP
  gate_up_proj ([gate rows; up rows] of the rank) and down_proj; MoE: gate.weight, gate.e_score_correction_bias in
  float32 (noaux_tc; GLM-4.5 always), experts.w13_weight
  [experts, 2 x shard, hidden] and w2_weight [experts, hidden, shard], shared_experts.gate_up_proj/down_proj, or
  with `fuse_shared_experts` the shared expert as expert n_routed_experts of w13/w2.
- load_weights(weights), one call: q_a_proj and kv_a_proj_with_mqa are cached in a dict local to the call and
  loaded fused once both came (one without the other is dropped); every other tensor goes to its parameter
  (narrowed to the rank's rows unless the layer's use_presharded_weights is on; copied in the parameter's dtype);
  then post_load_weights for the layers whose kv_b_proj the call carried: w_kc [heads, nope, kv_lora] and w_vc
  [heads, kv_lora, v] (transposed views of contiguous copies), plain tensor attributes of self_attn, copied into
  in place after their first assignment (bind_or_assign). `rederive = False` skips that step: a loader that does
  not rerun SGLang's post-processing.
"""

from __future__ import annotations

import re

import torch
from torch import nn

PADDING = 64


class Linear(nn.Module):
    """A layer with one weight (and a bias where asked) and how TP cuts it: "column" (dim 0), "row" (dim 1), "vocab",
    None (replicated)."""

    def __init__(self, shape, tp_kind: str | None, dtype=torch.bfloat16, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(shape[0], dtype=dtype), requires_grad=False)
        self.tp_kind = tp_kind
        if tp_kind is not None:
            self.use_presharded_weights = False


class Gate(nn.Module):  # MoEGate
    def __init__(self, experts: int, hidden: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False) if bias else None


class Experts(nn.Module):  # FusedMoE, unquantized
    def __init__(self, experts: int, hidden: int, shard: int):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(experts, 2 * shard, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(experts, hidden, shard, dtype=torch.bfloat16), requires_grad=False)
        self.use_presharded_weights = False


class Attention(nn.Module):  # DeepseekV2AttentionMLA
    def __init__(self, hf: dict, tp: int):
        super().__init__()
        h, heads = hf["hidden_size"], hf["num_attention_heads"] // tp
        nope, rope, v, kv_lora = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["kv_lora_rank"]
        self.nope, self.v = nope, v
        if hf.get("q_lora_rank"):
            q_lora = hf["q_lora_rank"]
            self.fused_qkv_a_proj_with_mqa = Linear((q_lora + kv_lora + rope, h), None)
            self.q_a_layernorm = Linear((q_lora,), None)
            self.q_b_proj = Linear((heads * (nope + rope), q_lora), "column")
        else:
            self.q_proj = Linear((heads * (nope + rope), h), "column")
            self.kv_a_proj_with_mqa = Linear((kv_lora + rope, h), None)
        self.kv_b_proj = Linear((heads * (nope + v), kv_lora), "column")
        self.o_proj = Linear((h, heads * v), "row")
        self.kv_a_layernorm = Linear((kv_lora,), None)
        self.w_kc = None
        self.w_vc = None


class GqaAttention(nn.Module):  # Glm4MoeAttention
    def __init__(self, hf: dict, tp: int):
        super().__init__()
        h, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
        head_dim = hf.get("head_dim") or h // heads
        self.sizes = [heads // tp * head_dim] + 2 * [max(1, kv // tp) * head_dim]  # the rank's q, k, v rows
        self.kv_replicas = max(1, tp // kv)
        self.qkv_proj = Linear((sum(self.sizes), h), "qkv", bias=bool(hf.get("attention_bias")))
        self.o_proj = Linear((h, heads // tp * head_dim), "row")
        if hf.get("use_qk_norm"):
            self.q_norm, self.k_norm = Linear((head_dim,), None), Linear((head_dim,), None)


class MLP(nn.Module):  # DeepseekV2MLP
    def __init__(self, hidden: int, intermediate: int, tp: int):
        super().__init__()
        self.gate_up_proj = Linear((2 * intermediate // tp, hidden), "column")
        self.down_proj = Linear((hidden, intermediate // tp), "row")


class MoE(nn.Module):  # DeepseekV2MoE
    def __init__(self, hf: dict, tp: int, fuse_shared_experts: bool, ep: int):
        super().__init__()
        h, experts, inter = hf["hidden_size"], hf["n_routed_experts"], hf["moe_intermediate_size"]
        self.gate = Gate(experts, h, hf.get("topk_method") == "noaux_tc" or hf["model_type"] == "glm4_moe")
        self.experts = Experts(experts // ep + fuse_shared_experts, h, inter // (tp // ep))
        if hf.get("n_shared_experts") and not fuse_shared_experts:
            self.shared_experts = MLP(h, inter * hf["n_shared_experts"], tp)


class Decoder(nn.Module):
    def __init__(self, hf: dict, layer: int, tp: int, fuse_shared_experts: bool, ep: int):
        super().__init__()
        h = hf["hidden_size"]
        self.self_attn = Attention(hf, tp) if "kv_lora_rank" in hf else GqaAttention(hf, tp)
        moe = hf.get("n_routed_experts") and layer >= hf.get("first_k_dense_replace", 0) \
            and layer % hf.get("moe_layer_freq", 1) == 0
        self.mlp = MoE(hf, tp, fuse_shared_experts, ep) if moe else MLP(h, hf["intermediate_size"], tp)
        self.input_layernorm = Linear((h,), None)
        self.post_attention_layernorm = Linear((h,), None)


class Body(nn.Module):
    def __init__(self, hf: dict, tp: int, fuse_shared_experts: bool, ep: int):
        super().__init__()
        padded = -(-hf["vocab_size"] // PADDING) * PADDING
        self.embed_tokens = Linear((padded // tp, hf["hidden_size"]), "vocab")
        self.layers = nn.ModuleList(Decoder(hf, i, tp, fuse_shared_experts, ep)
                                    for i in range(hf["num_hidden_layers"]))
        self.norm = Linear((hf["hidden_size"],), None)


class DeepseekRank(nn.Module):
    def __init__(self, hf: dict, rank: int, tp: int, fuse_shared_experts: bool = False, ep: int = 1):
        super().__init__()
        assert not (fuse_shared_experts and ep > 1), "SGLang fuses no shared expert under EP on NVIDIA GPUs"
        self.hf, self.rank, self.tp, self.fuse_shared_experts = hf, rank, tp, fuse_shared_experts
        moe_tp = tp // ep
        self.moe_ep_rank, self.moe_tp_rank = rank // moe_tp, rank % moe_tp
        self.local_experts = hf["n_routed_experts"] // ep
        self.model = Body(hf, tp, fuse_shared_experts, ep)
        padded = -(-hf["vocab_size"] // PADDING) * PADDING
        self.lm_head = Linear((padded // tp, hf["hidden_size"]), "vocab")
        self.rederive = True

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        owners = {f"{prefix}.{n}": m for prefix, m in self.named_modules() for n, _ in m.named_parameters(recurse=False)}
        cached, names = {}, []
        fuse_a = bool(self.hf.get("q_lora_rank"))
        for name, loaded in weights:
            if self.fuse_shared_experts and "mlp.shared_experts" in name:
                name = name.replace("mlp.shared_experts", f"mlp.experts.{self.hf['n_routed_experts']}")
            names.append(name)
            expert = re.match(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", name)
            stacked = re.match(r"(.*)\.(gate|up)_proj\.weight$", name)
            qkv = re.match(r"(.*)\.(q|k|v)_proj\.(weight|bias)$", name)
            if qkv and "kv_lora_rank" not in self.hf:
                self._load_qkv(owners[f"{qkv.group(1)}.qkv_proj.{qkv.group(3)}"], qkv.group(3), qkv.group(2), loaded)
            elif expert:
                self._load_expert(owners[expert.group(1) + "w13_weight"], int(expert.group(2)), expert.group(3), loaded)
            elif stacked:
                param = params[f"{stacked.group(1)}.gate_up_proj.weight"]
                layer = owners[f"{stacked.group(1)}.gate_up_proj.weight"]
                per = param.shape[0] // 2
                if not layer.use_presharded_weights:
                    loaded = loaded.narrow(0, self.rank * per, per)
                part = param.data[(stacked.group(2) == "up") * per:][:per]
                assert part.shape == loaded.shape, f"param_data.shape={part.shape} loaded_weight.shape={loaded.shape}"
                part.copy_(loaded)
            elif fuse_a and ("q_a_proj" in name or "kv_a_proj_with_mqa" in name):
                cached[name] = loaded
                q_a = name if "q_a_proj" in name else name.replace("kv_a_proj_with_mqa", "q_a_proj")
                kv_a = q_a.replace("q_a_proj", "kv_a_proj_with_mqa")
                if q_a in cached and kv_a in cached:
                    fused = torch.cat([cached.pop(q_a), cached.pop(kv_a)])
                    params[q_a.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")].data.copy_(fused)
            else:
                self._load(owners[name], params[name], loaded)
        if self.rederive:
            self.post_load_weights(names)

    def _load(self, layer, param, loaded) -> None:
        kind = getattr(layer, "tp_kind", None)
        presharded = getattr(layer, "use_presharded_weights", False)
        if kind == "vocab":
            vocab, per = self.hf["vocab_size"], param.shape[0]
            if presharded:
                assert loaded.shape[0] == vocab // self.tp, f"org_vocab_size={vocab} loaded_weight.shape={loaded.shape}"
            else:
                lo = self.rank * per
                loaded = loaded[lo:min(lo + per, vocab)]
            param.data[:loaded.shape[0]].copy_(loaded)
            param.data[loaded.shape[0]:].fill_(0)
            return
        if kind in ("column", "row") and not presharded:
            dim = 0 if kind == "column" else 1
            per = param.shape[dim]
            loaded = loaded.narrow(dim, self.rank * per, per)
        assert param.shape == loaded.shape, f"param_data.shape={param.shape} loaded_weight.shape={loaded.shape}"
        param.data.copy_(loaded)

    def _load_qkv(self, attention: Linear, kind: str, part: str, loaded) -> None:
        """QKVParallelLinear.weight_loader: the part's rows of this rank (K/V: of its head's rank, rank // replicas)
        at the part's offset in qkv_proj."""
        sizes = self.model.layers[0].self_attn.sizes
        index = "qkv".index(part)
        if not attention.use_presharded_weights:
            shard_rank = self.rank if part == "q" else self.rank // self.model.layers[0].self_attn.kv_replicas
            loaded = loaded.narrow(0, shard_rank * sizes[index], sizes[index])
        target = getattr(attention, kind).data[sum(sizes[:index]):][:sizes[index]]
        assert target.shape == loaded.shape, f"param_data.shape={target.shape} loaded_weight.shape={loaded.shape}"
        target.copy_(loaded)

    def _load_expert(self, experts: Experts, index: int, part: str, loaded) -> None:
        routed = self.hf["n_routed_experts"]
        if index >= routed:  # the fused shared expert: after the rank's routed ones
            index = index - routed + self.local_experts
        elif self.moe_ep_rank * self.local_experts <= index < (self.moe_ep_rank + 1) * self.local_experts:
            index -= self.moe_ep_rank * self.local_experts
        else:  # another EP rank's expert: FusedMoE drops it
            return
        if part == "down":
            shard = experts.w2_weight.shape[2]
            if not experts.use_presharded_weights:
                loaded = loaded.narrow(1, self.moe_tp_rank * shard, shard)
            assert experts.w2_weight.data[index].shape == loaded.shape
            experts.w2_weight.data[index].copy_(loaded)
            return
        shard = experts.w13_weight.shape[1] // 2
        if not experts.use_presharded_weights:
            loaded = loaded.narrow(0, self.moe_tp_rank * shard, shard)
        part_data = experts.w13_weight.data[index, (part == "up") * shard:][:shard]
        assert part_data.shape == loaded.shape, f"expert_data.shape={part_data.shape} loaded_weight.shape={loaded.shape}"
        part_data.copy_(loaded)

    def post_load_weights(self, weight_names) -> None:
        layers = {int(n.split(".")[2]) for n in weight_names if "kv_b_proj" in n}
        for i in sorted(layers):
            attn = self.model.layers[i].self_attn
            w_kc, w_vc = attn.kv_b_proj.weight.unflatten(0, (-1, attn.nope + attn.v)).split([attn.nope, attn.v], dim=1)
            attn.w_kc = _bind_or_assign(attn.w_kc, w_kc.transpose(1, 2).contiguous().transpose(1, 2))
            attn.w_vc = _bind_or_assign(attn.w_vc, w_vc.contiguous().transpose(1, 2))


def _bind_or_assign(target, source):
    if target is not None:
        target.copy_(source)
        return target
    return source
