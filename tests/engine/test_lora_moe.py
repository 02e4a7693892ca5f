"""LoRA on a mixture-of-experts policy (Qwen3-MoE): adapters on the attention projections and on every routed expert
equal peft's LoRA on the same tiny HF model at EP=2 and at TP=2 (the experts split over expert-TP 2): fp32 log-probs
and the adapters' gradients. transformers 5 holds a layer's experts as two fused 3-D parameters
(mlp.experts.gate_up_proj, mlp.experts.down_proj), which peft adapts through target_parameters: one adapter per
expert on the fused gate and up rows, one on down, the reference here. B = 0 gives the base exactly; the base stays
frozen; a checkpoint of the adapters written at EP=2 loads at TP=2; the PEFT directory written at either layout holds peft's own keys and tensors and peft's model from it gives
the trainer's log-probs; the merged export is the base plus scale x B A per expert. What cannot be adapted so is
refused by key before any worker starts."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megarl.config import ActorConfig, AlgorithmConfig, ConfigError
from megarl.config.model_layout import check_model_layout, check_rollout_model
from megarl.config.sections import LoraConfig, ParallelConfig
from megarl.config.tiny import tiny_config
from tests.dist_utils import run_distributed
from tests.engine.hf_models import padded_batch
from tests.engine.test_lora import ALPHA, RANK, _adapter, _aligned_logprobs, _grads_and_logprobs, _shard
from tests.models.hf_families import qwen3_moe_config, save_random

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS, PARAMETERS = 4, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SCALE = ALPHA / RANK


def _peft_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(model, PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ATTENTION,
                                                target_parameters=PARAMETERS))


def _peft_reference(model_dir: str, batch, coefficients, peft_dir: str):
    """peft's log-probs and, by (layer, projection) for attention and (layer, parameter, expert) for the experts, the
    adapters (A, B) and their gradients of sum(coefficients * log-probs), A and B random; peft's own directory."""
    model = _peft_model(model_dir)
    g = torch.Generator().manual_seed(3)
    wrappers = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            with torch.no_grad():
                for m in (module.lora_A["default"], module.lora_B["default"]):
                    m.weight.copy_(0.3 * torch.randn(m.weight.shape, generator=g))
            wrappers[name] = module
    logprobs = _aligned_logprobs(model, batch)
    (logprobs * coefficients).sum().backward()
    model.save_pretrained(peft_dir)
    adapters, grads = {}, {}
    for name, module in wrappers.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
        if not hasattr(module, "parameter_name"):
            key = layer, name.rsplit(".", 1)[1]
            adapters[key], grads[key] = (A.detach().clone(), B.detach().clone()), (A.grad.clone(), B.grad.clone())
            continue
        for e in range(EXPERTS):  # peft's fused layout: expert e's A rows e*r + j, its B columns j*E + e
            rows, columns = slice(e * RANK, (e + 1) * RANK), [j * EXPERTS + e for j in range(RANK)]
            key = layer, module.parameter_name, e
            adapters[key] = (A[rows].detach().clone(), B[:, columns].detach().clone())
            grads[key] = (A.grad[rows].clone(), B.grad[:, columns].clone())
    return logprobs.detach(), adapters, grads


def _expert_adapter(engine, layer: int, parameter: str, expert: int):
    """This rank's adapter of a global expert, None where another EP rank holds it."""
    mlp = engine.gpt.decoder.layers[layer].mlp
    if expert not in mlp.local_expert_indices:
        return None
    local = mlp.experts.local_experts[mlp.local_expert_indices.index(expert)]
    return (local.linear_fc1 if parameter == "gate_up_proj" else local.linear_fc2).lora.adapters[parameter]


def _expert_shard(full: torch.Tensor, parameter: str, which: str) -> torch.Tensor:
    """This expert-TP rank's part: gate_up's B its gate rows and its up rows, down's A its columns."""
    from megatron.core import parallel_state

    etp, rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                 parallel_state.get_expert_tensor_parallel_rank())
    if which == "B" and parameter == "gate_up_proj":
        return torch.cat([half.chunk(etp, 0)[rank] for half in full.chunk(2, 0)])
    if which == "A" and parameter == "down_proj":
        return full.chunk(etp, 1)[rank]
    return full


def _check_layout(model_dir, batch, coefficients, reference, out, layout, sequence_parallel: bool, resume: bool):
    """The engine of this layout against peft, its adapters set to the reference's (or, `resume`, loaded from the
    checkpoint another layout wrote); its PEFT directory written to out/layout; its merged export."""
    from megarl.engine import MegatronEngine
    from megarl.engine.lora_peft import save_peft

    logprobs, adapters, grads = reference
    section = ActorConfig(micro_batch_size=8, lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"]),
                          parallel=ParallelConfig(sequence_parallel=sequence_parallel))
    engine = MegatronEngine(model_dir, section, AlgorithmConfig(), "cpu", 1, 10)
    base = engine.compute_logprobs(batch, reference=True)["ref_logprobs"]
    assert torch.equal(engine.compute_logprobs(batch)["logprobs"], base)  # B = 0 as built
    trainable = [n for n, p in engine.gpt.named_parameters() if p.requires_grad]
    assert trainable and all(".lora.adapters." in n for n in trainable), trainable
    assert any(".local_experts." in n for n in trainable)
    pairs = {}
    for key in adapters:
        if len(key) == 2:
            pairs[key] = _adapter(engine, *key), lambda full, which, proj=key[1]: _shard(full, proj, which)
        elif (adapter := _expert_adapter(engine, *key)) is not None:
            pairs[key] = adapter, lambda full, which, parameter=key[1]: _expert_shard(full, parameter, which)
    assert len(pairs) == 2 * 4 + 2 * 2 * EXPERTS // engine.gpt.decoder.layers[0].mlp.ep_group.size()
    if resume:
        engine.load_checkpoint(f"{out}/checkpoint", optimizer=False)  # no update yet: no Adam state
    with torch.no_grad():
        for key, (adapter, shard) in pairs.items():
            for which, param, full in zip("AB", (adapter.A, adapter.B), adapters[key]):
                if resume:  # resharded from EP=2 to expert-TP 2 (the fused gate_up B by gate and up rows)
                    assert torch.equal(param, shard(full, which)), (key, which)
                param.copy_(shard(full, which))
    if not resume:
        engine.save_checkpoint(f"{out}/checkpoint")
    torch.testing.assert_close(_grads_and_logprobs(engine, batch, coefficients), logprobs, rtol=0, atol=2e-5)
    for key, (adapter, shard) in pairs.items():
        for which, got, want in zip("AB", (adapter.A.main_grad, adapter.B.main_grad), grads[key]):
            want = shard(want, which)
            # fp32 sums in another order: within 1e-3 of the gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item(), msg=str(key))
    assert torch.equal(engine.compute_logprobs(batch, reference=True)["ref_logprobs"], base)  # adapters off
    assert save_peft(engine, f"{out}/{layout}", model_dir) > 0
    return {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}


def _check_rank(rank, model_dir, batch, coefficients, reference, out):
    from megatron.core import parallel_state

    from megarl.parallel.state import build_model_parallel

    merged = {}
    # EP=2: 2 of the 4 experts a rank; TP=2: expert-TP 2, with sequence parallelism (megatron's MoE layer refuses
    # to train under TP without it), the adapters from EP=2's checkpoint
    for layout, tp, ep in (("ep2", 1, 2), ("tp2", 2, 1)):
        parallel_state.destroy_model_parallel()
        build_model_parallel(tp, 1, 1, ep=ep)
        merged[layout] = _check_layout(model_dir, batch, coefficients, reference, out, layout, tp > 1, tp > 1)
    return merged


def test_lora_on_the_experts_and_attention_of_a_moe_matches_peft_at_ep2_and_tp2_and_exports(tmp_path):
    model_dir = save_random(qwen3_moe_config(tied=False, norm_topk_prob=True), tmp_path / "moe", seed=7)
    batch = padded_batch()
    coefficients = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(5))
    reference = _peft_reference(model_dir, batch, coefficients, str(tmp_path / "peft"))
    assert len(reference[1]) == 2 * 4 + 2 * 2 * EXPERTS  # every expert of both layers routed to in the batch
    assert all(gA.abs().sum() > 0 and gB.abs().sum() > 0 for gA, gB in reference[2].values())
    merged = run_distributed(_check_rank, 2, model_dir, batch, coefficients, reference, str(tmp_path))

    want = load_file(f"{tmp_path}/peft/adapter_model.safetensors")  # peft's own keys and fused layout
    for layout in ("ep2", "tp2"):
        written = load_file(f"{tmp_path}/{layout}/adapter_model.safetensors")
        assert sorted(written) == sorted(want), layout
        for k in want:
            torch.testing.assert_close(written[k], want[k], rtol=0, atol=0, msg=k)
        config = json.loads((tmp_path / layout / "adapter_config.json").read_text())
        assert (config["target_modules"], config["target_parameters"]) == (sorted(ATTENTION), sorted(PARAMETERS))
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                         f"{tmp_path}/{layout}")
        with torch.no_grad():
            torch.testing.assert_close(_aligned_logprobs(peft, batch), reference[0], rtol=0, atol=2e-5)
    # the merged export: base + scale B A per expert, under the checkpoint's names; transformers' model from it
    plain = load_file(f"{model_dir}/model.safetensors")
    assert sorted(merged["ep2"]) == sorted(plain)
    for key, (A, B) in reference[1].items():
        if len(key) == 3:
            layer, parameter, e = key
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            names = [prefix + "gate_proj.weight", prefix + "up_proj.weight"] if parameter == "gate_up_proj" else [
                prefix + "down_proj.weight"]
            delta = (SCALE * B @ A).chunk(len(names), 0)
            for name, d in zip(names, delta):
                for layout in ("ep2", "tp2"):
                    torch.testing.assert_close(merged[layout][name], plain[name] + d, rtol=0, atol=1e-6)
    merged_dir = tmp_path / "merged"
    shutil.copytree(model_dir, merged_dir)
    save_file(merged["ep2"], str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        got = _aligned_logprobs(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32), batch)
    torch.testing.assert_close(got, reference[0], rtol=0, atol=5e-5)  # (W + s B A) x against W x + s B (A x)


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.target_modules=q_proj,up_proj"], r"gate and up projections are one fused parameter \(gate_up_proj\)"
                                                   r" in transformers and peft, adapted whole: target gate_proj and "
                                                   r"up_proj together, or neither"),
    (["actor.lora.dropout=0.1"], r"^actor.lora.dropout=0.1 with actor.lora.target_modules=all-linear on the tiny MoE, "
                                 r"a mixture-of-experts model: down_proj, gate_proj, up_proj adapt its routed experts, "
                                 r"and peft's LoRA on transformers' fused experts has no dropout")])
def test_what_lora_cannot_adapt_on_a_moe_is_refused_by_key(overrides, message):
    hf = qwen3_moe_config(tied=False, norm_topk_prob=True).to_dict()
    common = ["actor.parallel.world_size=2", "actor.parallel.ep=2", "actor.lora.rank=4", "sft.steps=0"]
    check_model_layout(tiny_config(common).actor, "actor", hf, "the tiny MoE")  # all-linear: experts included
    with pytest.raises(ConfigError, match=message):
        check_model_layout(tiny_config(common + overrides).actor, "actor", hf, "the tiny MoE")
    adapter_sync = tiny_config(common + ["rollout.lora_sync=adapter"])
    with pytest.raises(ConfigError, match=r"^rollout.lora_sync=adapter with actor.lora.target_modules=all-linear on "
                                          r"the tiny MoE: the adapters of its routed experts"):
        check_rollout_model(adapter_sync, hf, "the tiny MoE")
    attention = tiny_config(common + ["rollout.lora_sync=adapter", "actor.lora.dropout=0.1",
                                      "actor.lora.target_modules=q_proj,k_proj,v_proj,o_proj"])
    check_model_layout(attention.actor, "actor", hf, "the tiny MoE")
    check_rollout_model(attention, hf, "the tiny MoE")
