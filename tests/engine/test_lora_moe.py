"""LoRA on a mixture-of-experts policy (Qwen3-MoE) at EP=2: adapters on the attention projections equal peft's LoRA
on the same tiny HF model (fp32 log-probs and the adapters' gradients), B = 0 gives the base exactly and the experts
stay frozen; the MLP projections, which name the experts, are refused by key before any worker starts."""

import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig, ConfigError
from megarl.config.model_layout import check_model_layout
from megarl.config.sections import LoraConfig, ParallelConfig
from megarl.config.tiny import tiny_config
from tests.dist_utils import run_distributed
from tests.engine.hf_models import padded_batch
from tests.engine.test_lora import ALPHA, RANK, _adapter, _grads_and_logprobs, _peft_reference, _shard
from tests.models.hf_families import qwen3_moe_config, save_random

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _check_ep2(rank, model_dir, batch, coefficients, reference):
    from megatron.core import parallel_state

    from megarl.engine import MegatronEngine
    from megarl.parallel.state import build_model_parallel

    parallel_state.destroy_model_parallel()
    build_model_parallel(1, 1, 1, ep=2)  # each rank holds 2 of the 4 experts
    logprobs, adapters, grads = reference
    section = ActorConfig(micro_batch_size=8, parallel=ParallelConfig(world_size=2, ep=2),
                          lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=ATTENTION))
    engine = MegatronEngine(model_dir, section, AlgorithmConfig(), "cpu", 1, 10)
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    base = engine.compute_logprobs(batch, reference=True)["ref_logprobs"]
    assert torch.equal(engine.compute_logprobs(batch)["logprobs"], base)  # B = 0 as built
    trainable = [n for n, p in engine.gpt.named_parameters() if p.requires_grad]
    assert trainable and all(".self_attention." in n and ".lora.adapters." in n for n in trainable), trainable
    with torch.no_grad():
        for (layer, proj), (A, B) in adapters.items():
            _adapter(engine, layer, proj).A.copy_(_shard(A, proj, "A"))
            _adapter(engine, layer, proj).B.copy_(_shard(B, proj, "B"))
    torch.testing.assert_close(_grads_and_logprobs(engine, batch, coefficients), logprobs, rtol=0, atol=2e-5)
    for (layer, proj), (gA, gB) in grads.items():
        adapter = _adapter(engine, layer, proj)
        for got, want in ((adapter.A.main_grad, gA), (adapter.B.main_grad, gB)):
            # fp32 sums in another order: within 1e-3 of the gradient's scale
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
    assert torch.equal(engine.compute_logprobs(batch, reference=True)["ref_logprobs"], base)  # adapters off
    return True


def test_lora_on_the_attention_of_a_moe_at_ep2_matches_peft(tmp_path):
    model_dir = save_random(qwen3_moe_config(tied=False, norm_topk_prob=True), tmp_path / "moe", seed=7)
    batch = padded_batch()
    coefficients = torch.randn(batch["tokens"].shape, generator=torch.Generator().manual_seed(5))
    reference = _peft_reference(model_dir, batch, coefficients, targets=ATTENTION)
    assert sorted({proj for _, proj in reference[1]}) == sorted(ATTENTION)
    assert run_distributed(_check_ep2, 2, model_dir, batch, coefficients, reference)


@pytest.mark.parametrize("targets, named", [("all-linear", "down_proj, gate_proj, up_proj"),
                                            ("q_proj,up_proj", "up_proj")])
def test_lora_on_the_experts_of_a_moe_is_refused_by_key(targets, named):
    cfg = tiny_config(["actor.parallel.world_size=2", "actor.parallel.ep=2", "actor.lora.rank=4",
                       f"actor.lora.target_modules={targets}", "sft.steps=0"])
    hf = qwen3_moe_config(tied=False, norm_topk_prob=True).to_dict()
    with pytest.raises(ConfigError, match=rf"^actor.lora.target_modules={targets}: the tiny MoE is a mixture-of-"
                                          rf"experts model \(4 routed experts per MoE layer, here over actor.parallel."
                                          rf"ep=2\); .*which {named} name there: target the attention projections"):
        check_model_layout(cfg.actor, "actor", hf, "the tiny MoE")
    attention = tiny_config(["actor.parallel.world_size=2", "actor.parallel.ep=2", "actor.lora.rank=4",
                             "actor.lora.target_modules=q_proj,k_proj,v_proj,o_proj", "sft.steps=0"])
    check_model_layout(attention.actor, "actor", hf, "the tiny MoE")
