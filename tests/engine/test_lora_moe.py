"""LoRA on mixture-of-experts policies against peft's LoRA on the same tiny HF models (fp32 log-probs and every
adapter's gradient): Qwen3-MoE with its attention and routed experts adapted, at EP=2 and at TP=2 with sequence
parallelism (the experts split over expert-TP 2, the adapters loaded from the EP=2 checkpoint); GLM-4.5 with a dense
first layer and a shared expert beside its experts, and Mixtral, at EP=2.

The reference is peft 0.21 as a user calls it, target_modules naming the attention and MLP projections. On
transformers 5 a layer's experts are two fused 3-D parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj); peft
rewrites the MLP names into target_parameters on them (its ParamWrapper), reading gate_proj and up_proj as one
block-diagonal adapter of rank 2r on gate_up_proj (transformers 4's per-expert gate and up adapters), which is
megarl's per-expert gate and up adapters exactly. It then reaches nothing else by those names, so the dense layer's
and the shared expert's linear projections are given to peft by their weights. B = 0 gives the base exactly; the base
stays frozen (one optimizer update at EP=2 moves the adapters, the experts' included, and nothing else); the PEFT
directory written at each layout is the one peft saves and peft's model from it gives the trainer's log-probs; the
merged export is the base plus scale x B A per expert. What cannot be adapted so is refused by key before any worker
starts."""

import json
import shutil
from pathlib import Path

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
from tests.engine.test_lora import ALPHA, RANK, _aligned_logprobs, _grads_and_logprobs, _shard
from tests.models.hf_families import glm4_moe_config, mixtral_config, qwen3_moe_config, save_random

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ("gate_proj", "up_proj", "down_proj")
SCALE = ALPHA / RANK


def _peft_model(model_dir: str, dense_mlp: tuple[str, ...] = (), names: tuple[str, ...] = MLP):
    """peft's LoRA as a user asks for it: the attention and MLP projections by name, which on transformers 5's MoE
    models peft turns into the experts' fused parameters (gate and up: one block-diagonal adapter of rank 2r and
    alpha 2 alpha); `dense_mlp`: the linear MLP modules of dense layers and shared experts (model.layers.0.mlp), which
    it then reaches by their weights alone; `names`: the checkpoint's names of an expert's gate, up and down (Mixtral's
    w1, w3, w2), which peft rewrites so."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = [f"{m}.{proj}.weight" for m in dense_mlp for proj in MLP]
    return get_peft_model(model, PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                target_modules=ATTENTION + list(names), target_parameters=weights))


def _peft_reference(model_dir: str, batch, coefficients, peft_dir: str, dense_mlp: tuple[str, ...] = (),
                    names: tuple[str, ...] = MLP):
    """peft's log-probs and, by module (model.layers.0.self_attn.q_proj) for the linear ones and (layer, projection,
    expert) for the experts, the adapters (A, B) and their gradients of sum(coefficients * log-probs), A and B random
    (an expert's gate_up B block-diagonal: gate's rows on gate's rank, up's on up's); peft's own directory."""
    model = _peft_model(model_dir, dense_mlp, names)
    g = torch.Generator().manual_seed(3)
    wrappers = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
            with torch.no_grad():
                A.copy_(0.3 * torch.randn(A.shape, generator=g))
                B.copy_(0.3 * torch.randn(B.shape, generator=g))
                if getattr(module, "parameter_name", None) == "gate_up_proj":
                    rank = A.shape[0] // module.num_experts
                    columns = torch.arange(B.shape[1]) // module.num_experts < rank // 2  # gate's rank
                    rows = torch.arange(B.shape[0]) < B.shape[0] // 2  # gate's rows
                    B.mul_((rows[:, None] == columns[None]).float())
            wrappers[name.removeprefix("base_model.model.")] = module
    logprobs = _aligned_logprobs(model, batch)
    (logprobs * coefficients).sum().backward()
    model.save_pretrained(peft_dir)
    adapters, grads = {}, {}
    for name, module in wrappers.items():
        A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
        if getattr(module, "parameter_name", "weight") == "weight":  # a linear module (or its weight)
            name = name.removesuffix(".base_layer")
            adapters[name], grads[name] = (A.detach().clone(), B.detach().clone()), (A.grad.clone(), B.grad.clone())
            continue
        layer, experts = int(name.split(".layers.")[1].split(".")[0]), module.num_experts
        rank = A.shape[0] // experts
        for e in range(experts):  # peft's fused layout: expert e's A rows e*R + j, its B columns j*E + e
            rows, columns = slice(e * rank, (e + 1) * rank), [j * experts + e for j in range(rank)]
            pair, grad = (A[rows], B[:, columns]), (A.grad[rows], B.grad[:, columns])
            if module.parameter_name == "down_proj":
                adapters[layer, "down_proj", e] = tuple(t.detach().clone() for t in pair)
                grads[layer, "down_proj", e] = tuple(t.clone() for t in grad)
                continue
            for half, proj in enumerate(("gate_proj", "up_proj")):  # its block of the block-diagonal adapter
                r, o = slice(half * RANK, (half + 1) * RANK), slice(half * B.shape[0] // 2, (half + 1) * B.shape[0] // 2)
                adapters[layer, proj, e] = (pair[0][r].detach().clone(), pair[1][o, r].detach().clone())
                grads[layer, proj, e] = (grad[0][r].clone(), grad[1][o, r].clone())
    return logprobs.detach(), adapters, grads


def _linear_adapter(engine, module: str):
    """The adapter of an HF linear module (model.layers.1.mlp.shared_experts.up_proj) in the megatron model."""
    _, _, layer, *path, proj = module.split(".")
    block = engine.gpt.decoder.layers[int(layer)]
    block = block.self_attention if path == ["self_attn"] else block.mlp
    if path[1:] == ["shared_experts"]:
        block = block.shared_experts
    linear = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}[proj]
    return getattr(block, linear).lora.adapters[proj]


def _expert_adapter(engine, layer: int, proj: str, expert: int):
    """This rank's adapter of a global expert, None where another EP rank holds it."""
    mlp = engine.gpt.decoder.layers[layer].mlp
    if expert not in mlp.local_expert_indices:
        return None
    local = mlp.experts.local_experts[mlp.local_expert_indices.index(expert)]
    return (local.linear_fc2 if proj == "down_proj" else local.linear_fc1).lora.adapters[proj]


def _expert_shard(full: torch.Tensor, proj: str, which: str) -> torch.Tensor:
    """This expert-TP rank's part (gate's and up's B their rows, down's A its columns)."""
    from megatron.core import parallel_state

    etp, rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                 parallel_state.get_expert_tensor_parallel_rank())
    if which == "B" and proj != "down_proj":
        return full.chunk(etp, 0)[rank]
    if which == "A" and proj == "down_proj":
        return full.chunk(etp, 1)[rank]
    return full


def _check_layout(model_dir, batch, coefficients, reference, out, layout, sequence_parallel: bool, checkpoint=None):
    """The engine of this layout against peft, its adapters set to the reference's (checkpoint "save": then written
    to out/checkpoint; "load": loaded from there, written by another layout, first); its PEFT directory written to
    out/layout. Returns the engine."""
    from megatron.core import parallel_state

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
        if isinstance(key, str):
            proj = key.rsplit(".", 1)[1]
            pairs[key] = _linear_adapter(engine, key), lambda full, which, proj=proj: _shard(full, proj, which)
        elif (adapter := _expert_adapter(engine, *key)) is not None:
            pairs[key] = adapter, lambda full, which, proj=key[1]: _expert_shard(full, proj, which)
    experts = [key for key in adapters if not isinstance(key, str)]
    ep = parallel_state.get_expert_model_parallel_world_size()
    assert len(pairs) == len(adapters) - len(experts) + len(experts) // ep  # this EP rank's experts
    adapted = sum(p.numel() for p in engine.lora.parameters())
    assert adapted == sum(p.numel() for p in engine.gpt.parameters() if p.requires_grad)  # the base frozen
    if checkpoint == "load":
        engine.load_checkpoint(f"{out}/checkpoint", optimizer=False)  # no update yet: no Adam state
    with torch.no_grad():
        for key, (adapter, shard) in pairs.items():
            for which, param, full in zip("AB", (adapter.A, adapter.B), adapters[key]):
                if checkpoint == "load":  # resharded from EP=2 to expert-TP 2
                    assert torch.equal(param, shard(full, which)), (key, which)
                param.copy_(shard(full, which))
    if checkpoint == "save":
        engine.save_checkpoint(f"{out}/checkpoint")
    torch.testing.assert_close(_grads_and_logprobs(engine, batch, coefficients), logprobs, rtol=0, atol=2e-5)
    for key, (adapter, shard) in pairs.items():
        for which, got, want in zip("AB", (adapter.A.main_grad, adapter.B.main_grad), grads[key]):
            want = shard(want, which)
            # fp32 sums in another order: within 1e-3 of the gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item(), msg=str(key))
    assert torch.equal(engine.compute_logprobs(batch, reference=True)["ref_logprobs"], base)  # adapters off
    assert save_peft(engine, f"{out}/{layout}", model_dir) > 0
    return engine


def _check_rank(rank, model_dir, batch, coefficients, reference, out):
    from megatron.core import parallel_state

    from megarl.parallel.state import build_model_parallel

    merged = {}
    # EP=2: 2 of the 4 experts a rank; TP=2: expert-TP 2, with sequence parallelism (megatron's MoE layer refuses
    # to train under TP without it), the adapters from EP=2's checkpoint
    for layout, tp, ep in (("ep2", 1, 2), ("tp2", 2, 1)):
        parallel_state.destroy_model_parallel()
        build_model_parallel(tp, 1, 1, ep=ep)
        engine = _check_layout(model_dir, batch, coefficients, reference, out, layout, tp > 1,
                               "load" if tp > 1 else "save")
        merged[layout] = {n: t.clone() for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    return merged


def _check_peft_directory(model_dir, directory, peft_dir, batch=None, logprobs=None):
    """megarl's PEFT directory holds what peft's own holds (keys, tensors, targets, rank and alpha patterns) and
    peft's model from it gives the trainer's log-probs (`logprobs`, where given)."""
    want, written = (load_file(f"{d}/adapter_model.safetensors") for d in (peft_dir, directory))
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[k], want[k]) for k in want), [k for k in want if not torch.equal(written[k], want[k])]
    config, peft_config = (json.loads(Path(d, "adapter_config.json").read_text()) for d in (directory, peft_dir))
    for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern"):
        assert config[key] == peft_config[key], key
    for key in ("target_modules", "target_parameters"):
        assert sorted(config[key]) == sorted(peft_config[key]), key
    if logprobs is None:
        return
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), directory)
    with torch.no_grad():
        torch.testing.assert_close(_aligned_logprobs(peft, batch), logprobs, rtol=0, atol=2e-5)


def test_lora_on_the_experts_and_attention_of_a_moe_matches_peft_at_ep2_and_tp2_and_exports(tmp_path):
    model_dir = save_random(qwen3_moe_config(tied=False, norm_topk_prob=True), tmp_path / "moe", seed=7)
    batch = padded_batch()
    coefficients = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(5))
    reference = _peft_reference(model_dir, batch, coefficients, str(tmp_path / "peft"))
    assert len(reference[1]) == 2 * 4 + 2 * 3 * 4  # attention, and gate, up and down of the 4 experts of both layers
    assert all(gA.abs().sum() > 0 and gB.abs().sum() > 0 for gA, gB in reference[2].values())
    merged = run_distributed(_check_rank, 2, model_dir, batch, coefficients, reference, str(tmp_path))
    _check_peft_directory(model_dir, tmp_path / "ep2", tmp_path / "peft", batch, reference[0])
    _check_peft_directory(model_dir, tmp_path / "tp2", tmp_path / "peft")  # the same files
    # the merged export: base + scale B A per expert, under the checkpoint's names; transformers' model from it
    plain = load_file(f"{model_dir}/model.safetensors")
    assert sorted(merged["ep2"]) == sorted(plain)
    for key, (A, B) in reference[1].items():
        name = f"model.layers.{key[0]}.mlp.experts.{key[2]}.{key[1]}.weight" if len(key) == 3 else f"{key}.weight"
        for layout in ("ep2", "tp2"):
            torch.testing.assert_close(merged[layout][name], plain[name] + SCALE * B @ A, rtol=0, atol=1e-6)
    merged_dir = tmp_path / "merged"
    shutil.copytree(model_dir, merged_dir)
    save_file(merged["ep2"], str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        got = _aligned_logprobs(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32), batch)
    torch.testing.assert_close(got, reference[0], rtol=0, atol=5e-5)  # (W + s B A) x against W x + s B (A x)


def _check_ep2_rank(rank, model_dir, batch, coefficients, reference, out):
    from megatron.core import parallel_state

    from megarl.parallel.state import build_model_parallel

    parallel_state.destroy_model_parallel()
    build_model_parallel(1, 1, 1, ep=2)
    engine = _check_layout(model_dir, batch, coefficients, reference, out, "ep2", False)
    # one update from the gradients above: megatron's optimizer takes the expert adapters (its expert-parallel part)
    before = {n: p.detach().clone() for n, p in engine.gpt.named_parameters()}
    assert engine.optimizer.step()[0]
    after = dict(engine.gpt.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == {n for n, p in after.items() if p.requires_grad}, sorted(set(before) - moved)[:5]
    return True


@pytest.mark.parametrize("family", ["glm4_moe", "mixtral"])
def test_lora_on_glm45s_dense_layer_and_shared_expert_and_on_mixtrals_experts_matches_peft_at_ep2(tmp_path, family):
    """GLM-4.5: layer 0 a dense MLP, layer 1 a MoE with a shared expert (linear gate, up and down projections in
    transformers) beside 8 routed experts (4 an EP rank), all adapted at once; peft reaches the dense and shared
    projections by their weights (target_parameters), since it reads their names as the experts'. Mixtral: its
    checkpoint's block_sparse_moe.experts.{e}.w1/w3/w2, the names a peft user gives. Each PEFT directory is peft's and
    gives the trainer's log-probs."""
    batch = padded_batch()
    coefficients = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(5))
    if family == "glm4_moe":
        model_dir = save_random(glm4_moe_config(), tmp_path / family, seed=7)
        reference = _peft_reference(model_dir, batch, coefficients, str(tmp_path / "peft"),
                                    dense_mlp=("mlp", "mlp.shared_experts"))
        modules = [key for key in reference[1] if isinstance(key, str)]
        assert "model.layers.0.mlp.gate_proj" in modules and "model.layers.1.mlp.shared_experts.down_proj" in modules
        assert len(reference[1]) == 2 * 4 + 3 + 3 + 3 * 8
    else:
        model_dir = save_random(mixtral_config(), tmp_path / family, seed=7)
        reference = _peft_reference(model_dir, batch, coefficients, str(tmp_path / "peft"), names=("w1", "w3", "w2"))
        assert len(reference[1]) == 2 * 4 + 2 * 3 * 4
    assert run_distributed(_check_ep2_rank, 2, model_dir, batch, coefficients, reference, str(tmp_path))
    _check_peft_directory(model_dir, tmp_path / "ep2", tmp_path / "peft", batch, reference[0])


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.target_modules=q_proj,up_proj"], r"gate and up projections are one fused parameter \(gate_up_proj\)"
                                                   r" in transformers, which peft adapts for both or neither: target "
                                                   r"gate_proj and up_proj together, or neither"),
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
