"""LoRA on the megatron policy (actor.lora, megarl/engine/lora.py) against peft's LoRA on transformers' Qwen2 with the
same A and B: log-probs and the adapters' gradients in fp32 at TP=1, TP=2 and TP=2 with sequence parallelism; zero B
gives the base exactly; the export merges; the checkpoint holds the adapters and their Adam state alone and loads at
another TP."""

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.config import ActorConfig, AlgorithmConfig
from megarl.config.sections import LoraConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch

RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MEGATRON = {"q_proj": ("self_attention", "linear_qkv"), "k_proj": ("self_attention", "linear_qkv"),
            "v_proj": ("self_attention", "linear_qkv"), "o_proj": ("self_attention", "linear_proj"),
            "gate_proj": ("mlp", "linear_fc1"), "up_proj": ("mlp", "linear_fc1"), "down_proj": ("mlp", "linear_fc2")}
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}


def _aligned_logprobs(model, batch) -> torch.Tensor:
    """log p(tokens[t] | <t) [B, T], 0 at t=0 and padding (hf_models.hf_logprobs_entropy's, with gradients)."""
    tokens, mask = batch["tokens"], batch["attention_mask"]
    logp = torch.log_softmax(model(input_ids=tokens, attention_mask=mask).logits.float()[:, :-1], -1)
    lp = torch.where(mask[:, 1:] > 0, logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), 0.0)
    return torch.nn.functional.pad(lp, (1, 0))


def _peft_reference(model_dir: str, batch, coefficients, targets=TARGETS):
    """peft's log-probs and gradients of sum(coefficients * log-probs) by (layer, projection) for A and B, with A
    and B random (B non-zero)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets))
    g = torch.Generator().manual_seed(3)
    adapters = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            layer, proj = int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1]
            with torch.no_grad():
                A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
                A.copy_(0.3 * torch.randn(A.shape, generator=g))
                B.copy_(0.3 * torch.randn(B.shape, generator=g))
            adapters[layer, proj] = (A, B)
    logprobs = _aligned_logprobs(model, batch)
    (logprobs * coefficients).sum().backward()
    return (logprobs.detach(), {k: (A.detach().clone(), B.detach().clone()) for k, (A, B) in adapters.items()},
            {k: (A.grad.clone(), B.grad.clone()) for k, (A, B) in adapters.items()})


def _adapter(engine, layer: int, proj: str):
    block, linear = MEGATRON[proj]
    return getattr(getattr(engine.gpt.decoder.layers[layer], block), linear).lora.adapters[proj]


def _shard(full: torch.Tensor, proj: str, which: str) -> torch.Tensor:
    """This TP rank's part of a full A or B (column-parallel: B's rows; row-parallel: A's columns)."""
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if which == "B" and proj in COLUMN:
        return full.chunk(tp, 0)[rank]
    if which == "A" and proj not in COLUMN:
        return full.chunk(tp, 1)[rank]
    return full


def _grads_and_logprobs(engine, batch, coefficients):
    """The engine's log-probs and the adapters' gradients of sum(coefficients * log-probs) (one micro-batch)."""
    engine._set_mode(True)
    mbs = engine._micro_batches(batch, [])
    assert len(mbs) == 1

    def loss_fn(mb, output):
        logprobs, _ = engine.aligned_logprobs(mb, output, False)
        return (logprobs * coefficients[mb["seq_index"], :logprobs.shape[1]]).sum(), {}

    for model in engine.models:
        model.zero_grad_buffer()
    engine._run_schedule(mbs, loss_fn, forward_only=False)
    return engine.compute_logprobs(batch)["logprobs"]


def _check_layout(model_dir, batch, coefficients, reference, sequence_parallel: bool, base=None):
    """The LoRA engine against peft (`reference`); against the engine `base` (no LoRA) when given, else against its
    own forward with the adapters off."""
    from megarl.engine import MegatronEngine

    logprobs, adapters, grads = reference
    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    section = ActorConfig(micro_batch_size=8, lora=lora, parallel=ParallelConfig(sequence_parallel=sequence_parallel))
    engine = MegatronEngine(model_dir, section, AlgorithmConfig(), "cpu", 1, 10)
    # B = 0 as built: the base model exactly; the reference (adapters off) is the base too
    base_logprobs = (base or engine).compute_logprobs(batch, reference=base is None)
    base_logprobs = base_logprobs["ref_logprobs" if base is None else "logprobs"]
    assert torch.equal(engine.compute_logprobs(batch)["logprobs"], base_logprobs)
    trainable = [p for p in engine._parameters() if p.requires_grad]
    assert trainable and all(any(p is q for q in engine.lora.parameters()) for p in trainable)
    assert sum(p.numel() for p in trainable) < sum(p.numel() for p in engine._parameters()) / 3
    with torch.no_grad():
        for (layer, proj), (A, B) in adapters.items():
            adapter = _adapter(engine, layer, proj)
            adapter.A.copy_(_shard(A, proj, "A"))
            adapter.B.copy_(_shard(B, proj, "B"))
    torch.testing.assert_close(_grads_and_logprobs(engine, batch, coefficients), logprobs, rtol=0, atol=2e-5)
    for (layer, proj), (gA, gB) in grads.items():
        adapter = _adapter(engine, layer, proj)
        for got, want in ((adapter.A.main_grad, _shard(gA, proj, "A")), (adapter.B.main_grad, _shard(gB, proj, "B"))):
            # fp32 sums in another order: within 1e-3 of the gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
    assert torch.equal(engine.compute_logprobs(batch, reference=True)["ref_logprobs"], base_logprobs)
    # the export merges: W + (alpha / rank) B A in the HF layout
    exported = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    plain = load_file(f"{model_dir}/model.safetensors")
    for (layer, proj), (A, B) in adapters.items():
        name = f"model.layers.{layer}.{'mlp' if proj in MLP else 'self_attn'}.{proj}.weight"
        torch.testing.assert_close(exported[name], plain[name] + ALPHA / RANK * B @ A, rtol=0, atol=1e-6)
    assert sorted(exported) == sorted(plain)
    assert all(torch.equal(exported[n], plain[n]) for n in plain if "_proj." not in n)
    return engine


def _full_adapters(engine) -> dict[str, torch.Tensor]:
    """Every adapter matrix whole (the TP shards of a split one gathered), by parameter name."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, p in engine.gpt.named_parameters():
        if ".lora." in name:
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            full[name] = torch.cat(parts, p.partition_dim) if getattr(p, "tensor_model_parallel", False) else p.detach()
    return full


def _adam_state(engine, name: str) -> torch.Tensor:
    param = dict(engine.gpt.named_parameters())[name]
    return engine.optimizer.optimizer.state[param]["exp_avg"]


def _check_dropout(model_dir, batch, coefficients, reference):
    """Dropout on the adapters' input at TP=2: the gradients change, and those of a column-parallel layer's A (whole
    on every rank) stay equal across the TP ranks (the same mask on each)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.engine import MegatronEngine

    _, adapters, grads = reference
    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.5, target_modules=["all-linear"])
    engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=8, lora=lora), AlgorithmConfig(), "cpu", 1, 10)
    with torch.no_grad():
        for (layer, proj), (A, B) in adapters.items():
            _adapter(engine, layer, proj).A.copy_(_shard(A, proj, "A"))
            _adapter(engine, layer, proj).B.copy_(_shard(B, proj, "B"))
    _grads_and_logprobs(engine, batch, coefficients)
    group = parallel_state.get_tensor_model_parallel_group()
    for (layer, proj), (gA, _) in grads.items():
        got = _adapter(engine, layer, proj).A.main_grad
        assert not torch.allclose(got, _shard(gA, proj, "A"), rtol=0, atol=1e-3 * gA.abs().max().item()), proj
        if proj in COLUMN:
            parts = [torch.empty_like(got) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, got.contiguous(), group=group)
            assert all(torch.equal(part, parts[0]) for part in parts), proj


def _check_rank(rank, model_dir, batch, coefficients, reference, checkpoint):
    from megatron.core import parallel_state
    from torch.distributed.checkpoint import FileSystemReader

    from megarl.engine import MegatronEngine
    from megarl.engine.checkpoint_dir import CheckpointError
    from megarl.parallel.state import build_model_parallel

    base = MegatronEngine(model_dir, ActorConfig(micro_batch_size=8), AlgorithmConfig(), "cpu", 1, 10, trainable=False)
    engine = _check_layout(model_dir, batch, coefficients, reference, sequence_parallel=False, base=base)  # TP=2
    # one update of the adapters (the gradients above), then a checkpoint of them alone, loaded at TP=1 below
    assert engine.optimizer.step()[0]
    trained, logprobs = _full_adapters(engine), engine.compute_logprobs(batch)["logprobs"]
    replicated = "decoder.layers.0.self_attention.linear_qkv.lora.adapters.q_proj.A"
    adam = _adam_state(engine, replicated).clone()
    engine.save_checkpoint(checkpoint)
    saved = [k for k in FileSystemReader(f"{checkpoint}/state").read_metadata().state_dict_metadata
             if not k.startswith(("optimizer.", "rng_state"))]  # the model's tensors, by their sharded keys
    assert saved and all(".lora.adapters." in k for k in saved), saved
    _check_layout(model_dir, batch, coefficients, reference, sequence_parallel=True)
    _check_dropout(model_dir, batch, coefficients, reference)
    parallel_state.destroy_model_parallel()
    build_model_parallel(1, 1, 1)  # TP=1 (two data-parallel ranks of the same batch)
    _check_layout(model_dir, batch, coefficients, reference, sequence_parallel=False)
    section = ActorConfig(micro_batch_size=8, lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"]))
    resumed = MegatronEngine(model_dir, section, AlgorithmConfig(), "cpu", 1, 10)
    resumed.load_checkpoint(checkpoint)
    loaded = _full_adapters(resumed)
    assert sorted(loaded) == sorted(trained) and all(torch.equal(loaded[n], trained[n]) for n in trained)
    assert torch.equal(_adam_state(resumed, replicated), adam)
    torch.testing.assert_close(resumed.compute_logprobs(batch)["logprobs"], logprobs, rtol=0, atol=1e-5)
    plain = MegatronEngine(model_dir, ActorConfig(micro_batch_size=8), AlgorithmConfig(), "cpu", 1, 10)
    with pytest.raises(CheckpointError, match="written with actor.lora .*'rank': 4.*this engine has off"):
        plain.load_checkpoint(checkpoint)
    return True


def test_lora_matches_peft_at_tp1_tp2_and_sequence_parallel_and_its_checkpoint_loads_at_tp1(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    batch = padded_batch()
    coefficients = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(5))
    reference = _peft_reference(model_dir, batch, coefficients)
    assert all(gB.abs().sum() > 0 and gA.abs().sum() > 0 for gA, gB in reference[2].values())
    assert run_distributed(_check_rank, 2, model_dir, batch, coefficients, reference, str(tmp_path / "ckpt"), tp=2)
