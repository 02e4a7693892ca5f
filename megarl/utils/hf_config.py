"""Fields of a model's config.json that several layers read the same way: the config checks (megarl.config.
model_layout), the HF tensor inventory and the planner (megarl.reshard)."""

from __future__ import annotations

# config.json spellings of the routed-expert count: DeepSeek, Qwen3-MoE, transformers >= 5
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
# model types whose layers mix linear attention (a gated delta net) and full attention by `layer_types`
HYBRID_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# of those, the ones with a single gated shared expert per MoE layer (shared_expert_intermediate_size wide)
GATED_SHARED_EXPERT = ("qwen3_5_moe_text", "qwen3_next")


# Gemma3TextConfig's defaults (transformers 4.50 to 5.12): the published multimodal Gemma 3 config.json files
# (google/gemma-3-4b-it ...) leave most of their text_config to them (the 4B's names neither its heads nor its
# vocabulary)
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "attn_logit_softcapping": None, "final_logit_softcapping": None}
# multimodal model types whose vision tower megarl keeps untrained and unused (text-only RL on the language model):
# model type -> the tensor prefixes of the tower and its projector (transformers' on-disk names, SGLang's too)
TEXT_ONLY_TOWERS = {"gemma3": ("vision_tower.", "multi_modal_projector."), "qwen3_5": ("model.visual.",),
                    "qwen3_5_moe": ("model.visual.",)}


def language_fields(hf: dict) -> dict:
    """The language model's fields of a config.json: the top level, with a multimodal model's text_config over it
    (transformers >= 5 writes Qwen2.5-VL's that way; the published checkpoints keep them at the top level), except
    tie_word_embeddings: transformers ties a multimodal model's output layer by the top level's (a Qwen3-VL-MoE
    config.json written by transformers 5 says false there and true, its text config's default, in text_config).
    A multimodal Gemma 3's (model_type gemma3) over Gemma3TextConfig's defaults, as model_type gemma3_text."""
    fields = {**{k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}, **hf.get("text_config", {})}
    if "text_config" in hf and "tie_word_embeddings" in hf:
        fields["tie_word_embeddings"] = hf["tie_word_embeddings"]
    if hf.get("model_type") == "gemma3":
        fields = {**GEMMA3_TEXT_DEFAULTS, **fields, "model_type": "gemma3_text"}
    return fields


def expert_width(hf: dict) -> tuple[int, str]:
    """Each routed expert's FFN width and the config key that gives it: moe_intermediate_size (DeepSeek, Qwen3-MoE),
    Mixtral's and gpt-oss's intermediate_size (they have no other); 0 where the config gives none."""
    key = "intermediate_size" if hf.get("model_type") in ("mixtral", "gpt_oss") else "moe_intermediate_size"
    return hf.get(key, 0), key


def routed_experts(hf: dict) -> int:
    """Routed experts per MoE layer under any of the configs' names for them (a multimodal config's under its
    text_config: Qwen3-VL-MoE); 0 for a dense model."""
    fields = language_fields(hf)
    return next((fields[key] for key in _EXPERT_KEYS if fields.get(key)), 0)


def shared_expert_width(hf: dict) -> int:
    """The summed FFN width of a MoE layer's shared experts: DeepSeek's n_shared_experts x moe_intermediate_size,
    Qwen3-Next's shared_expert_intermediate_size; 0 for none."""
    if hf.get("model_type") in GATED_SHARED_EXPERT:
        return hf.get("shared_expert_intermediate_size", 0)
    return (hf.get("n_shared_experts") or 0) * hf.get("moe_intermediate_size", 0)


# model types whose config.json may leave tie_word_embeddings out, meaning true (transformers' default for them)
_TIED_BY_DEFAULT = ("gemma3_text",)
# model types whose attention runs megatron's unfused DotProductAttention, scores stored (Gemma 3's windows,
# gpt-oss's windows and sinks)
UNFUSED_ATTENTION = ("gemma3_text", "gpt_oss")
# model types the engine trains at expert-tensor-parallel size 1 only (gpt-oss's expert biases): its module says why
EXPERT_TENSOR_PARALLEL_ONE = ("gpt_oss",)


def parallel_limit(hf: dict, tp: int, etp: int, cp: int = 1) -> str | None:
    """Why the engine cannot train this model at tensor-parallel size `tp`, expert-TP size `etp` and context-parallel
    size `cp`, naming the size it takes ("tp=1", "etp=1", "cp=1"), or None where it can."""
    fields = language_fields(hf)
    model_type = fields.get("model_type")
    if tp > 1 and model_type in HYBRID_ATTENTION and fields["linear_num_key_heads"] % tp:
        return (f"{model_type} at tp={tp}: TP must divide linear_num_key_heads={fields['linear_num_key_heads']} (each "
                "rank holds whole key heads of its linear-attention layers)")
    if etp > 1 and model_type in EXPERT_TENSOR_PARALLEL_ONE:
        return f"{model_type} trains its experts at etp=1 only (megatron-core adds expert biases only there)"
    if cp > 1 and model_type in HYBRID_ATTENTION:
        return f"{model_type} trains at cp=1 only (megatron-core's gated delta net asserts context parallelism off)"
    if cp > 1 and model_type in UNFUSED_ATTENTION:
        return (f"{model_type} trains at cp=1 only (its sliding windows and sinks run in megatron's unfused "
                "attention, which has no context parallelism)")
    return None


def tied_embeddings(hf: dict) -> bool:
    """Whether the output layer is the embedding: tie_word_embeddings, or the model type's default where absent."""
    return bool(hf.get("tie_word_embeddings", hf.get("model_type") in _TIED_BY_DEFAULT))


def layer_types(hf: dict) -> list[str]:
    """Each layer's token mixer in a hybrid model (Qwen3.5: "linear_attention" or "full_attention"); transformers'
    default where config.json has none: full attention every full_attention_interval-th (4th) layer."""
    interval = hf.get("full_attention_interval", 4)
    return hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                     for i in range(hf["num_hidden_layers"])]
