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


def _check_lora_targets(section, role: str, hf: dict, experts: int, where: str) -> None:
    """actor.lora's MLP projections on a mixture-of-experts model: its MoE layers' experts (split over EP), router
    and shared experts are no megatron linear that megarl/engine/lora.py adapts, so the targets are refused by key
    here rather than in a training rank (and all-linear does not quietly mean fewer projections than peft's)."""
    lora = getattr(section, "lora", None)
    if lora is None or not lora.rank or not experts:
        return
    mlp = sorted(lora_targets(lora) & {"gate_proj", "up_proj", "down_proj"})
    if mlp:
        raise ConfigError(
            f"{role}.lora.target_modules={','.join(lora.target_modules)}: {where} is a mixture-of-experts model "
            f"({experts} routed experts per MoE layer, here over {role}.parallel.ep={section.parallel.ep}); LoRA does "
            f"not adapt experts, their router or shared experts, which {', '.join(mlp)} name there: target the "
            f"attention projections alone ({role}.lora.target_modules=q_proj,k_proj,v_proj,o_proj)")


def check_rollout_model(cfg, hf: dict, where: str) -> None:
    """Raise ConfigError for a sync into the rollout engine that cannot move or check a model's weights (gpt-oss's
    and Qwen3-VL-MoE's stacked experts, reshard.inventory.STACKED_EXPERTS: full delivery only, and into SGLang no
    checksum verification: weight_layout.layout_for says why), and for a quantized model.path with
    rollout.engine=sglang: SGLang starts from the checkpoint as stored, so it would serve a quantized model
    (DeepSeek-V3's release is block-wise FP8) and then take the policy's unquantized weights into it. The error
    names the conversion to a bf16 directory (megarl.convert reads block-wise FP8 dequantized)."""
    from megarl.reshard.inventory import STACKED_EXPERTS

    r, t = cfg.rollout, cfg.trainer
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
