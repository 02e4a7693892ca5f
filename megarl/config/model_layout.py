"""A training role's layout against its model's config.json: the checks that need the model (its layers, heads
and experts), run by the dry run (`python -m megarl.train --dry-run`) before any worker starts, so a layout
that cannot work is an error naming its key rather than a failure inside a training rank. And the policy's
checkpoint against the rollout engine that starts from it (check_rollout_model).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from megarl.config.validation import ConfigError, lora_targets
from megarl.parallel.stages import stage_layers
from megarl.utils.hf_config import expert_width, language_fields, parallel_limit, routed_experts


def check_model_layout(section, role: str, hf: dict, where: str) -> tuple[int, ...]:
    """Raise ConfigError naming the `role`'s key (e.g. actor.parallel.pp_first_stage_layers) whose layout the
    model (its config.json `hf`, read from `where`) cannot take; returns the decoder layers of each stage. A
    vision-language model's language fields may sit under text_config (transformers >= 5)."""
    hf = language_fields(hf)
    p, keys = section.parallel, f"{role}.parallel"
    kv_heads = hf.get("num_key_value_heads") or hf.get("num_attention_heads", 1)
    if kv_heads % p.tp:
        raise ConfigError(f"{keys}.tp={p.tp} must divide num_key_value_heads={kv_heads} of {where} (each TP rank "
                          "holds whole query groups)")
    try:
        stages = stage_layers(hf["num_hidden_layers"], p.pp, p.pp_first_stage_layers, p.pp_last_stage_layers,
                              p.vpp, keys)
    except ValueError as e:
        raise ConfigError(f"{e} ({where})") from None
    if limit := parallel_limit(hf, p.tp, 1):
        raise ConfigError(f"{keys}.tp={p.tp} with {where}: {limit}: set {keys}.tp=1")
    if limit := parallel_limit(hf, 1, p.etp or p.tp):
        raise ConfigError(f"{keys}.etp={p.etp} (0 = tp, here {p.tp}) with {where}: {limit}: set {keys}.etp=1")
    if limit := parallel_limit(hf, 1, 1, p.cp):
        raise ConfigError(f"{keys}.cp={p.cp} with {where}: {limit}: set {keys}.cp=1")
    experts = routed_experts(hf)
    if not experts and (p.ep > 1 or p.etp > 1):
        raise ConfigError(f"{keys}.ep={p.ep} and {keys}.etp={p.etp} split experts, and {where} has none (a dense "
                          "model): leave them at 1 and 0")
    if experts and experts % p.ep:
        raise ConfigError(f"{keys}.ep={p.ep} must divide the {experts} routed experts of {where}")
    if getattr(section, "router_replay", "off") != "off" and not experts:
        raise ConfigError(f"{role}.router_replay={section.router_replay} replays the experts the rollout routed "
                          f"tokens to, and {where} has none (a dense model): set {role}.router_replay=off")
    width, width_key = expert_width(hf)
    if experts and width % (p.etp or p.tp):
        raise ConfigError(f"{keys}.etp={p.etp or p.tp} (0 = tp) must divide each expert's {width_key}="
                          f"{width} of {where}")
    _check_lora_targets(section, role, hf, experts, where)
    if "mla_up_proj" in section.recompute_modules and not hf.get("kv_lora_rank"):
        raise ConfigError(f"{role}.recompute_modules: mla_up_proj needs multi-latent attention, which {where} "
                          "does not have (no kv_lora_rank)")
    return stages


MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def lora_adapts_experts(section, hf: dict) -> bool:
    """Whether actor.lora (in `section`) puts adapters on the routed experts of the model (config.json `hf`)."""
    lora = getattr(section, "lora", None)
    return bool(lora is not None and lora.rank and routed_experts(language_fields(hf))
                and lora_targets(lora) & set(MLP_TARGETS))


def _check_lora_targets(section, role: str, hf: dict, experts: int, where: str) -> None:
    """actor.lora's MLP projections on a mixture-of-experts model name its routed experts (megarl/engine/lora.py),
    shared experts and dense MLP layers. What cannot be adapted as peft adapts transformers' fused experts (or what
    megarl keeps in an expert module of its own) is refused by key here rather than in a training rank."""
    lora = getattr(section, "lora", None)
    if lora is None or not lora.rank or not experts:
        return
    key = f"{role}.lora.target_modules={','.join(lora.target_modules)}"
    mlp = sorted(lora_targets(lora) & set(MLP_TARGETS))
    if not mlp:
        return
    attention_only = f"target the attention projections alone ({role}.lora.target_modules=q_proj,k_proj,v_proj,o_proj)"
    from megarl.reshard.inventory import STACKED_EXPERTS

    if hf.get("model_type") in STACKED_EXPERTS:
        raise ConfigError(f"{key}: {where} (model_type={hf.get('model_type')!r}) stacks its experts with biases in "
                          f"megarl's own expert module; LoRA adapts megatron's SequentialMLP experts only, and "
                          f"{', '.join(mlp)} name them there: {attention_only}")
    if len({"gate_proj", "up_proj"} & set(mlp)) == 1:
        raise ConfigError(f"{key}: {where} is a mixture-of-experts model ({experts} routed experts per MoE layer, "
                          f"here over {role}.parallel.ep={section.parallel.ep}), whose experts' gate and up "
                          "projections are one fused parameter (gate_up_proj) in transformers, which peft adapts for "
                          "both or neither: target gate_proj and up_proj together, or neither")
    if lora.dropout:
        raise ConfigError(f"{role}.lora.dropout={lora.dropout} with {key} on {where}, a mixture-of-experts model: "
                          f"{', '.join(mlp)} adapt its routed experts, and peft's LoRA on transformers' fused "
                          "experts has no dropout (no PEFT directory could hold the run): set "
                          f"{role}.lora.dropout=0, or {attention_only}")


def check_rollout_model(cfg, hf: dict, where: str) -> None:
    """Raise ConfigError for a sync into the rollout engine that cannot move or check a model's weights (gpt-oss's
    and Qwen3-VL-MoE's stacked experts, reshard.inventory.STACKED_EXPERTS: full delivery only, and into SGLang no
    checksum verification: weight_layout.layout_for says why), and for a quantized model.path with
    rollout.engine=sglang: SGLang starts from the checkpoint as stored, so it would serve a quantized model
    (DeepSeek-V3's release is block-wise FP8) and then take the policy's unquantized weights into it. The error
    names the conversion to a bf16 directory (megarl.convert reads block-wise FP8 dequantized)."""
    from megarl.reshard.inventory import STACKED_EXPERTS

    r, t = cfg.rollout, cfg.trainer
    if r.lora_sync == "adapter" and lora_adapts_experts(cfg.actor, hf):
        raise ConfigError(f"rollout.lora_sync=adapter with actor.lora.target_modules="
                          f"{','.join(cfg.actor.lora.target_modules)} on {where}: the adapters of its routed experts "
                          "(peft's target_parameters) are loaded by neither rollout engine's adapter path; use "
                          "rollout.lora_sync=merged")
    if language_fields(hf).get("model_type") in STACKED_EXPERTS:
        stacks = f"{where}: model_type={hf.get('model_type')!r} stacks each layer's experts in a few tensors"
        if r.weight_delivery != "full":
            raise ConfigError(f"{stacks}, which the weight sync moves whole only: set rollout.weight_delivery=full "
                              f"(got {r.weight_delivery})")
        if r.engine == "sglang" and t.verify_weight_sync_every > 0 and not t.verify_weight_sync_deep:
            raise ConfigError(f"{stacks}, whose place in SGLang's FusedMoE checksum verification does not model: set "
                              "trainer.verify_weight_sync_deep=true (SGLang reloads what was sent with its own loader "
                              "and compares) or trainer.verify_weight_sync_every=0")
    if cfg.rollout.engine == "sglang":
        from megarl.rollout.sglang_layout import check_hybrid_rollout

        rollout = cfg.rollout
        refusal = check_hybrid_rollout(language_fields(hf), rollout.sglang_tp, rollout.weight_delivery,
                                       rollout.sglang_args)
        if refusal:
            raise ConfigError(f"{where}: {refusal}")
    quantization = hf.get("quantization_config")
    if r.engine != "sglang" or not quantization:
        return
    source = Path(cfg.model.path)
    imported, bf16 = source.with_name(source.name + "-megarl"), source.with_name(source.name + "-bf16")
    commands = [f"python -m megarl.convert hf-to-megatron {shlex.quote(str(source))} {shlex.quote(str(imported))}",
                f"python -m megarl.convert megatron-to-hf {shlex.quote(str(imported))} {shlex.quote(str(bf16))} "
                "--dtype bfloat16"]
    raise ConfigError(f"model.path={cfg.model.path} is a quantized checkpoint ({where} has quantization_config="
                      f"{json.dumps(quantization)}): rollout.engine=sglang would start it as a quantized model and "
                      "then receive the policy's bf16 weights into it. Convert it to bf16 first (block-wise FP8 is "
                      "read dequantized) and set model.path to the result:\n  " + "\n  ".join(commands) +
                      f"\nthen model.path={bf16}")
