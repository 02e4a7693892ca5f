"""The HF tensors of a model, from its config.json alone, with how tensor parallelism cuts each one.

The resharder and the planner (megarl.plan) share this list: the planner for models megarl cannot
build on this machine (DeepSeek-V3, Qwen3-MoE), the resharder to know which rows of each HF tensor
a training rank holds and a generation rank needs. A tensor is cut along one dimension into TP
contiguous row blocks (rank r gets block r), or replicated:
- column-parallel weights (q/k/v, gate/up, experts' gate/up, MLA's q_b/kv_b) and q/k/v biases: dim 0;
- row-parallel weights (o_proj, down_proj): dim 1;
- embeddings and the output layer: dim 0, the vocabulary padded to a multiple of TP (pad rows
  belong to no HF tensor);
- norms, routers and MLA's down-projections (q_a, kv_a): replicated.
Routed experts carry their index (Mixtral's: block_sparse_moe.experts.{e}.w1/w3/w2, the others'
mlp.experts.{e}.gate_proj/up_proj/down_proj): expert parallelism places whole experts (megarl.reshard.layout), and
expert-TP (training) or SGLang's MoE TP (generation) cuts each as TP cuts a dense MLP. Shared experts are
dense MLPs.
Head-structured tensors are cut between heads. A gated delta net's in_proj_qkv and conv1d stack q, k and v, each cut
by heads: their rows are counted in TP order, each rank's heads of every part one block (`TensorSpec.parts`), and the
resharder puts a whole one back in the HF order. K/V projections with TP above their head count (and a
multiple of it) give each rank the one head its query heads use, as SGLang does; megatron cannot
train that way.
Every tensor is in the model's dtype except DeepSeek-V3's and GLM-4.5's routing bias (gate.e_score_correction_bias),
which megatron (models/router.py), transformers and SGLang all keep in float32: `TensorSpec.fp32`.
GLM-4.5 (glm4_moe): GQA with q/k/v biases (attention_bias) and q_norm/k_norm where use_qk_norm is set, dense MLPs in
its first first_k_dense_replace layers and DeepSeek-V3's experts after them.
gpt-oss (gpt_oss): GQA with q/k/v/o biases and per-head sinks, a biased router, and each layer's experts stacked in
four tensors (models/gpt_oss.py). For the planner each expert is listed as its row of them, `<stacked name>.{e}`
(gate_up_proj's row [hidden, 2 x intermediate], input-major with gate and up interleaved: a block of columns is
one expert-TP rank's gate and up rows). The resharder moves the rows, and a full delivery carries each stacked
tensor whole under its checkpoint name (`stacked_rows`: the resharder stacks a layer's rows once it holds them all;
megatron's export yields the same), as transformers and SGLang load it.
Gemma 3 (gemma3_text): q_norm/k_norm, and two more norms per layer (pre_feedforward_layernorm,
post_feedforward_layernorm); its embedding tied unless config.json says otherwise, and held whole on every generation
rank (SGLang's Gemma 3 embeds with a plain nn.Embedding, not a vocabulary-parallel one):
`TensorSpec.whole_for_generation`.
Vision-language models (Qwen2.5-VL, Qwen3-VL): the language model's tensors as a Qwen2's / Qwen3's (its fields at the
top of config.json, or under transformers 5's text_config: `language_fields`; Qwen3-VL's named model.language_model.*),
and the vision tower's `visual.*` (Qwen3-VL: `model.visual.*`) tensors, replicated (megatron keeps the tower whole on
every TP rank of the first pipeline stage: models/qwen2_vl_vision.py). Gemma 3's multimodal checkpoints (gemma3),
trained as text-only policies: the language model's tensors as gemma3_text's under language_model.model.*, no tower
(neither trained nor synced: models/gemma3_mm.py); Qwen3.5's and Qwen3.5-MoE's (qwen3_5, qwen3_5_moe) likewise, as
qwen3_5_text's / qwen3_5_moe_text's under model.language_model.* (models/qwen3_5_mm.py). Qwen3-VL-MoE (qwen3_vl_moe): Qwen3-VL's tower
and a Qwen3-MoE whose experts are stacked as gpt-oss's (without biases, gate and up as halves of gate_up_proj's
columns): listed by row, synced stacked alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from megarl.utils.hf_config import (GATED_SHARED_EXPERT, HYBRID_ATTENTION, expert_width, language_fields,
                                    layer_types, routed_experts, shared_expert_width, tied_embeddings)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dim: int | None  # the TP-split dimension; None = replicated on every TP rank
    layer: int | None  # decoder layer; None for the embedding (first stage) and the head/final norm (last)
    pad_vocab: bool = False
    units: int = 0  # attention heads the split dimension is made of (TP must cut between them); 0 = rows
    kv: bool = False  # K/V heads: TP above their count takes one head per rank (module docstring)
    expert: int | None = None  # a routed expert's index in its layer (EP places it); None for other tensors
    experts: int = 0  # routed experts of that layer
    fp32: bool = False  # kept in float32 whatever the model's dtype (DeepSeek-V3's routing bias)
    whole_for_generation: bool = False  # every generation rank holds all of it (Gemma 3's embedding in SGLang)
    # rows of the parts stacked along dim 0, each of which TP cuts by heads (a gated delta net's in_proj_qkv and conv1d:
    # [q; k; v]); () = none. Its rows are counted in TP order (`tp_order`), where each TP rank's rows are one block
    parts: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def length(self) -> int:
        """Rows along the split dimension (1 for a replicated tensor: it moves whole)."""
        return 1 if self.dim is None else self.shape[self.dim]

    @property
    def row_numel(self) -> int:
        return self.numel // self.length

    def itemsize(self, model_itemsize: int) -> int:
        """Bytes per element of this tensor in a model whose weights take `model_itemsize`."""
        return 4 if self.fp32 else model_itemsize

    def tp_order(self, tp: int) -> torch.Tensor:
        """The HF row at each row of a `parts` tensor cut by `tp`: TP rank 0's block of every part, then rank 1's...
        (megatron's layout of the gated delta net's in_proj and conv1d); the identity at TP 1."""
        starts = [sum(self.parts[:i]) for i in range(len(self.parts))]
        return torch.cat([torch.arange(start + r * (n // tp), start + (r + 1) * (n // tp))
                          for r in range(tp) for start, n in zip(starts, self.parts)])

    def rows(self, tp: int, rank: int) -> tuple[int, int]:
        """[lo, hi) rows of this tensor that TP rank `rank` of `tp` holds (may be empty: lo == hi), of a `parts`
        tensor in its TP order."""
        if self.dim is None:
            return 0, 1
        length = self.length
        if self.units and self.units % tp:
            if not (self.kv and tp % self.units == 0):
                raise ValueError(f"{self.name}: TP={tp} does not divide its {self.units} heads")
            head = rank // (tp // self.units)
            per_head = length // self.units
            return head * per_head, (head + 1) * per_head
        padded = -(-length // tp) * tp if self.pad_vocab else length
        if padded % tp:
            raise ValueError(f"{self.name}: TP={tp} does not divide its dimension {self.dim} of size {length}")
        block = padded // tp
        return min(rank * block, length), min((rank + 1) * block, length)


def on_first_stage(spec: TensorSpec) -> bool:
    """A tensor outside the decoder layers that the first pipeline stage holds (the embedding, the vision tower);
    the others (final norm, output layer) are the last stage's."""
    return "embed_tokens" in spec.name or spec.name.startswith(("visual.", "model.visual."))


def _get(hf: dict, *keys, default=None):
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


def _attention(hf: dict, p: str, layer: int) -> list[TensorSpec]:
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = _get(hf, "num_key_value_heads", default=heads)
    hd = _get(hf, "head_dim", default=h // heads)
    bias = hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias"))
    gate = 2 if hf.get("model_type") in HYBRID_ATTENTION else 1  # Qwen3.5's q_proj: per head, query then gate rows
    specs = [TensorSpec(p + "q_proj.weight", (gate * heads * hd, h), 0, layer, units=heads),
             TensorSpec(p + "k_proj.weight", (kv * hd, h), 0, layer, units=kv, kv=True),
             TensorSpec(p + "v_proj.weight", (kv * hd, h), 0, layer, units=kv, kv=True),
             TensorSpec(p + "o_proj.weight", (h, heads * hd), 1, layer, units=heads)]
    if bias:
        specs += [TensorSpec(p + "q_proj.bias", (heads * hd,), 0, layer, units=heads),
                  TensorSpec(p + "k_proj.bias", (kv * hd,), 0, layer, units=kv, kv=True),
                  TensorSpec(p + "v_proj.bias", (kv * hd,), 0, layer, units=kv, kv=True)]
    if hf.get("model_type") == "gpt_oss":
        specs += [TensorSpec(p + "o_proj.bias", (h,), None, layer),
                  TensorSpec(p + "sinks", (heads,), 0, layer, units=heads)]
    # per-head RMSNorm of queries and keys
    if hf.get("model_type", "").startswith(("qwen3", "gemma3")) or hf.get("use_qk_norm"):
        specs += [TensorSpec(p + "q_norm.weight", (hd,), None, layer),
                  TensorSpec(p + "k_norm.weight", (hd,), None, layer)]
    return specs


def _linear_attention(hf: dict, p: str, layer: int) -> list[TensorSpec]:
    """Qwen3.5's gated delta net. in_proj_qkv and conv1d stack q, k and v, each of which TP cuts by heads: no
    contiguous row block of the stacked tensor is one rank's, so their rows are counted in TP order
    (TensorSpec.parts), where each rank's rows are one block. Qwen3-Next's in_proj_qkvz and in_proj_ba hold each key
    head's rows together (models/qwen3_next.py): cut by key heads."""
    h, key_heads, value_heads = hf["hidden_size"], hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    qk, v = key_heads * hf["linear_key_head_dim"], value_heads * hf["linear_value_head_dim"]
    by_head = dict(units=value_heads)
    qkv = dict(units=key_heads, parts=(qk, qk, v))
    if hf.get("model_type") == "qwen3_next":
        specs = [TensorSpec(p + "in_proj_qkvz.weight", (2 * qk + 2 * v, h), 0, layer, units=key_heads),
                 TensorSpec(p + "in_proj_ba.weight", (2 * value_heads, h), 0, layer, units=key_heads)]
    else:
        specs = [TensorSpec(p + "in_proj_qkv.weight", (2 * qk + v, h), 0, layer, **qkv),
                 TensorSpec(p + "in_proj_z.weight", (v, h), 0, layer, **by_head),
                 TensorSpec(p + "in_proj_b.weight", (value_heads, h), 0, layer, **by_head),
                 TensorSpec(p + "in_proj_a.weight", (value_heads, h), 0, layer, **by_head)]
    return specs + [TensorSpec(p + "conv1d.weight", (2 * qk + v, 1, hf["linear_conv_kernel_dim"]), 0, layer, **qkv),
                    TensorSpec(p + "dt_bias", (value_heads,), 0, layer, **by_head),
                    TensorSpec(p + "A_log", (value_heads,), 0, layer, **by_head),
                    TensorSpec(p + "norm.weight", (hf["linear_value_head_dim"],), None, layer),
                    TensorSpec(p + "out_proj.weight", (h, v), 1, layer, **by_head)]


def _mla_attention(hf: dict, p: str, layer: int) -> list[TensorSpec]:
    """DeepSeek-V2/V3 multi-head latent attention."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    q_lora, kv_lora = hf.get("q_lora_rank"), hf["kv_lora_rank"]
    if q_lora:
        specs = [TensorSpec(p + "q_a_proj.weight", (q_lora, h), None, layer),
                 TensorSpec(p + "q_a_layernorm.weight", (q_lora,), None, layer),
                 TensorSpec(p + "q_b_proj.weight", (heads * (nope + rope), q_lora), 0, layer, units=heads)]
    else:
        specs = [TensorSpec(p + "q_proj.weight", (heads * (nope + rope), h), 0, layer, units=heads)]
    return specs + [TensorSpec(p + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h), None, layer),
                    TensorSpec(p + "kv_a_layernorm.weight", (kv_lora,), None, layer),
                    TensorSpec(p + "kv_b_proj.weight", (heads * (nope + v), kv_lora), 0, layer, units=heads),
                    TensorSpec(p + "o_proj.weight", (h, heads * v), 1, layer, units=heads)]


MIXTRAL_EXPERT_PARTS = ("w1", "w3", "w2")  # a Mixtral expert's gate, up and down projections (block_sparse_moe)


def _mlp(p: str, h: int, inter: int, layer: int, parts=("gate_proj", "up_proj", "down_proj"),
         **expert) -> list[TensorSpec]:
    gate, up, down = parts
    return [TensorSpec(f"{p}{gate}.weight", (inter, h), 0, layer, **expert),
            TensorSpec(f"{p}{up}.weight", (inter, h), 0, layer, **expert),
            TensorSpec(f"{p}{down}.weight", (h, inter), 1, layer, **expert)]


def _stacked_experts(hf: dict, p: str, layer: int) -> list[TensorSpec]:
    """gpt-oss's (biased) and Qwen3-VL-MoE's router and experts, each expert as its row of the stacked tensors
    (module docstring)."""
    h, experts, inter = hf["hidden_size"], routed_experts(hf), expert_width(hf)[0]
    biased = hf.get("model_type") == "gpt_oss"
    specs = [TensorSpec(p + ("router" if biased else "gate") + ".weight", (experts, h), None, layer)]
    specs += [TensorSpec(p + "router.bias", (experts,), None, layer)] if biased else []
    for e in range(experts):
        expert = dict(expert=e, experts=experts)
        specs.append(TensorSpec(f"{p}experts.gate_up_proj.{e}", (h, 2 * inter), 1, layer, **expert))
        specs += [TensorSpec(f"{p}experts.gate_up_proj_bias.{e}", (2 * inter,), 0, layer, **expert)] if biased else []
        specs.append(TensorSpec(f"{p}experts.down_proj.{e}", (inter, h), 0, layer, **expert))
        specs += [TensorSpec(f"{p}experts.down_proj_bias.{e}", (h,), None, layer, **expert)] if biased else []
    return specs


def _moe(hf: dict, p: str, layer: int) -> list[TensorSpec]:
    if hf.get("model_type") in STACKED_EXPERTS:
        return _stacked_experts(hf, p, layer)
    h, experts, inter = hf["hidden_size"], routed_experts(hf), expert_width(hf)[0]
    parts = MIXTRAL_EXPERT_PARTS if hf.get("model_type") == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    specs = [TensorSpec(p + "gate.weight", (experts, h), None, layer)]
    if has_routing_bias(hf):
        specs.append(TensorSpec(p + "gate.e_score_correction_bias", (experts,), None, layer, fp32=True))
    for e in range(experts):
        specs += _mlp(f"{p}experts.{e}.", h, inter, layer, parts, expert=e, experts=experts)
    if hf.get("model_type") in GATED_SHARED_EXPERT:  # one shared expert, scaled by sigmoid(shared_expert_gate(x))
        specs += _mlp(p + "shared_expert.", h, shared_expert_width(hf), layer)
        specs.append(TensorSpec(p + "shared_expert_gate.weight", (1, h), None, layer))
    elif hf.get("n_shared_experts"):
        specs += _mlp(p + "shared_experts.", h, shared_expert_width(hf), layer)
    return specs


def has_routing_bias(hf: dict) -> bool:
    """DeepSeek-V3's (and GLM-4.5's) load-balancing bias: transformers' DeepseekV3 and Glm4Moe MoE layers always have
    it, and noaux_tc routing (topk_method, often absent from config.json) is the only one megarl runs for them
    (models/deepseek_moe.py keys its router on the same test)."""
    return hf.get("model_type") in ("deepseek_v3", "glm4_moe")


def is_moe_layer(hf: dict, layer: int) -> bool:
    if hf.get("model_type", "").startswith("deepseek") or hf.get("model_type") == "glm4_moe":
        return layer >= hf.get("first_k_dense_replace", 0) and layer % hf.get("moe_layer_freq", 1) == 0
    if hf.get("model_type") in ("qwen3_moe", "qwen3_next", "qwen3_vl_moe_text"):
        step = hf.get("decoder_sparse_step", 1)
        return layer not in hf.get("mlp_only_layers", []) and (layer + 1) % step == 0
    return hf.get("model_type") in ("mixtral", "qwen3_5_moe_text", "gpt_oss")


def vision_tower(vision: dict) -> list[TensorSpec]:
    """Qwen2.5-VL's vision tower (transformers' names after `visual.`), every tensor replicated: the Conv3d patch
    embedding, the blocks (RMSNorms, fused qkv and proj with biases, SwiGLU with biases), the 2x2 patch merger."""
    d, inter, out = vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]
    patch, merged = vision["patch_size"], vision["hidden_size"] * vision["spatial_merge_size"] ** 2
    specs = [TensorSpec("visual.patch_embed.proj.weight",
                        (d, vision.get("in_channels", 3), vision["temporal_patch_size"], patch, patch), None, None)]
    for b in range(vision["depth"]):
        p = f"visual.blocks.{b}."
        specs += [TensorSpec(p + "norm1.weight", (d,), None, None), TensorSpec(p + "norm2.weight", (d,), None, None),
                  TensorSpec(p + "attn.qkv.weight", (3 * d, d), None, None),
                  TensorSpec(p + "attn.qkv.bias", (3 * d,), None, None),
                  TensorSpec(p + "attn.proj.weight", (d, d), None, None), TensorSpec(p + "attn.proj.bias", (d,), None, None)]
        for m, shape in (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
            specs += [TensorSpec(f"{p}mlp.{m}.weight", shape, None, None),
                      TensorSpec(f"{p}mlp.{m}.bias", shape[:1], None, None)]
    return specs + [TensorSpec("visual.merger.ln_q.weight", (d,), None, None),
                    TensorSpec("visual.merger.mlp.0.weight", (merged, merged), None, None),
                    TensorSpec("visual.merger.mlp.0.bias", (merged,), None, None),
                    TensorSpec("visual.merger.mlp.2.weight", (out, merged), None, None),
                    TensorSpec("visual.merger.mlp.2.bias", (out,), None, None)]


def qwen3_vision_tower(vision: dict) -> list[TensorSpec]:
    """Qwen3-VL's vision tower (transformers' names after `model.visual.`), every tensor replicated: the Conv3d patch
    embedding with its bias, the learned position embeddings, the blocks (LayerNorms, fused qkv and proj, a GELU MLP
    linear_fc1/linear_fc2, all with biases), the 2x2 patch merger and one more per DeepStack level (whose LayerNorm
    is over the merged patches)."""
    d, inter, out = vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]
    patch, merged = vision["patch_size"], vision["hidden_size"] * vision["spatial_merge_size"] ** 2
    conv = (d, vision.get("in_channels", 3), vision["temporal_patch_size"], patch, patch)
    shapes = {"patch_embed.proj.weight": conv, "patch_embed.proj.bias": (d,),
              "pos_embed.weight": (vision["num_position_embeddings"], d)}
    for b in range(vision["depth"]):
        for module, rows, cols in (("norm1", d, None), ("norm2", d, None), ("attn.qkv", 3 * d, d),
                                   ("attn.proj", d, d), ("mlp.linear_fc1", inter, d), ("mlp.linear_fc2", d, inter)):
            shapes |= {f"blocks.{b}.{module}.weight": (rows, cols) if cols else (rows,),
                       f"blocks.{b}.{module}.bias": (rows,)}
    deepstack = [f"deepstack_merger_list.{j}" for j in range(len(vision.get("deepstack_visual_indexes", [])))]
    for merger in ["merger"] + deepstack:
        norm = merged if merger != "merger" else d
        shapes |= {f"{merger}.norm.weight": (norm,), f"{merger}.norm.bias": (norm,),
                   f"{merger}.linear_fc1.weight": (merged, merged), f"{merger}.linear_fc1.bias": (merged,),
                   f"{merger}.linear_fc2.weight": (out, merged), f"{merger}.linear_fc2.bias": (out,)}
    return [TensorSpec("model.visual." + name, shape, None, None) for name, shape in shapes.items()]


SUPPORTED = ("qwen2", "llama", "qwen3", "qwen3_moe", "mistral", "mixtral", "deepseek_v3", "deepseek_v2", "glm4_moe",
             "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "gpt_oss",
             "gemma3_text", "qwen3_vl_moe_text")
# model types whose checkpoints stack each layer's experts in a few tensors: listed by row (`stacked_rows`)
STACKED_EXPERTS = ("gpt_oss", "qwen3_vl_moe_text")
_STACKED_ROW = re.compile(r"(.*\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?)\.(\d+)$")


def stacked_rows(specs: list[TensorSpec]) -> dict[str, tuple[str, int, int]]:
    """Each stacked expert row's name (`<stacked name>.{e}`) -> (the stacked checkpoint tensor's name, e, rows)."""
    rows = {}
    for spec in specs:
        match = _STACKED_ROW.match(spec.name) if spec.expert is not None else None
        if match:
            rows[spec.name] = (match.group(1), int(match.group(2)), spec.experts)
    return rows


def stacked_whole(specs: list[TensorSpec]) -> list[TensorSpec]:
    """`specs` with each stacked tensor's rows as one replicated spec of the whole tensor, under its checkpoint name
    and at its first row's place (what an engine holding the checkpoint's tensors holds)."""
    rows, out, seen = stacked_rows(specs), [], set()
    for spec in specs:
        if spec.name not in rows:
            out.append(spec)
            continue
        name = rows[spec.name][0]
        if name not in seen:
            seen.add(name)
            out.append(TensorSpec(name, (spec.experts, *spec.shape), None, spec.layer))
    return out
# vision-language model types: their language model's family in SUPPORTED, their tower's tensors, and what their
# checkpoint names the language model's `model.*` tensors under. A text-only policy's tower (Gemma 3's) is neither
# trained nor synced (the engine keeps the one it loaded): none listed.
VISION_LANGUAGE = {"qwen2_5_vl": ("qwen2", vision_tower, "model."),
                   "qwen3_vl": ("qwen3", qwen3_vision_tower, "model.language_model."),
                   "qwen3_vl_moe": ("qwen3_vl_moe_text", qwen3_vision_tower, "model.language_model."),
                   "gemma3": ("gemma3_text", lambda vision: [], "language_model.model."),
                   "qwen3_5": ("qwen3_5_text", lambda vision: [], "model.language_model."),
                   "qwen3_5_moe": ("qwen3_5_moe_text", lambda vision: [], "model.language_model.")}


def hf_inventory(hf: dict) -> list[TensorSpec]:
    """Every HF tensor of the model (multi-token-prediction layers excluded: RL does not train them); a
    vision-language model's vision tower first."""
    model_type = hf.get("model_type")
    if model_type in VISION_LANGUAGE:
        language, tower, prefix = VISION_LANGUAGE[model_type]
        text = hf_inventory(language_fields(hf) | {"model_type": language})
        return tower(hf["vision_config"]) + [replace(s, name=prefix + s.name[len("model."):])
                                             if s.name.startswith("model.") else s for s in text]
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type={model_type!r}: the inventory knows {', '.join(SUPPORTED + tuple(VISION_LANGUAGE))}")
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), 0, None, pad_vocab=True,
                        whole_for_generation=model_type == "gemma3_text")]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), None, i))
        if model_type in HYBRID_ATTENTION and layer_types(hf)[i] == "linear_attention":
            specs += _linear_attention(hf, p + "linear_attn.", i)
        elif "kv_lora_rank" in hf:
            specs += _mla_attention(hf, p + "self_attn.", i)
        else:
            specs += _attention(hf, p + "self_attn.", i)
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), None, i))
        if model_type == "gemma3_text":
            specs += [TensorSpec(p + f"{n}_feedforward_layernorm.weight", (h,), None, i) for n in ("pre", "post")]
        if is_moe_layer(hf, i):
            specs += _moe(hf, p + ("block_sparse_moe." if model_type == "mixtral" else "mlp."), i)
        else:
            specs += _mlp(p + "mlp.", h, hf["intermediate_size"], i)
    specs.append(TensorSpec("model.norm.weight", (h,), None, None))
    if not tied_embeddings(hf):
        specs.append(TensorSpec("lm_head.weight", (vocab, h), 0, None, pad_vocab=True))
    return specs
