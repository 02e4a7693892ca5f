"""Training through megatron's schedule, DDP and optimizer: the gradient and the update equal a plain
transformers + torch.optim.Adam step on the whole batch, at TP=2, DP=2 (token-mean split over DP
ranks and micro-batches) and PP=2 (1F1B, tied embeddings across stages)."""

import torch
from transformers import Qwen2ForCausalLM

from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch
from megarl.algorithms.losses import actor_loss
from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
from tests.dist_utils import run_distributed

LR = 1e-2
# the reference log-probs are random (~0.1) beside the policy's (~-5): k3 ~ exp(5) is past the default clamp of 10,
# which would zero the KL gradient this test compares; unclamped, as the estimator was written against
ALGO = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, kl_clamp=0.0)
LAYOUTS = ((2, 1), (1, 1), (1, 2))  # (tp, pp) on 2 ranks: TP=2, DP=2, PP=2


def rl_batch():
    batch = padded_batch(rows=8)
    g = torch.Generator().manual_seed(3)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=g) * batch["loss_mask"]
    batch["ref_logprobs"] = torch.randn(batch["tokens"].shape, generator=g) * 0.1 * batch["loss_mask"]
    return batch


def _relayout(tp, pp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1)


def _train_rank(rank, model_dir, ref_logprobs):
    from megatron.core import parallel_state as ps

    from megarl.engine import MegatronEngine

    results = {}
    for tp, pp in LAYOUTS:
        _relayout(tp, pp)
        actor = ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=LR, clip_grad=0.0))
        engine = MegatronEngine(model_dir, actor, ALGO, "cpu", 1, 10)
        batch = rl_batch()
        engine.snapshot_reference()
        batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
        torch.testing.assert_close(batch["old_logprobs"], ref_logprobs, rtol=0, atol=1e-5)
        share = batch.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
        metrics = engine.train(share, loss="policy")
        weights = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
        # The frozen reference still gives the pre-step log-probs; the policy moved.
        assert torch.equal(engine.compute_logprobs(batch, reference=True)["ref_logprobs"], batch["old_logprobs"])
        assert not torch.allclose(engine.compute_logprobs(batch)["logprobs"], batch["old_logprobs"])
        results[(tp, pp)] = (metrics, weights, engine.version)

    # Mini-batches x epochs, LR warmup, SFT with an LR override (at PP=2, the last layout).
    optim = OptimConfig(lr=1e-3, warmup_steps=2, decay_style="linear", clip_grad=1.0)
    engine = MegatronEngine(model_dir, ActorConfig(micro_batch_size=2, mini_batch_size=4, ppo_epochs=2, optim=optim),
                            AlgorithmConfig(), "cpu", 1, 10)
    batch = rl_batch()
    batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
    policy = engine.train(batch, loss="policy")
    sft = [engine.train(batch, loss="sft", lr=3e-2) for _ in range(4)]
    results["schedule"] = (policy, engine.version, sft)
    return results


def _hf_reference_step(model_dir):
    """Loss, metrics, grad norm and the weights after one Adam step, all on one process, whole batch."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = rl_batch()
    logits = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1)
    real = batch["attention_mask"][:, 1:] > 0
    pad = torch.nn.functional.pad
    logprobs = pad(torch.where(real, logp.gather(-1, batch["tokens"][:, 1:, None]).squeeze(-1), 0.0), (1, 0))
    entropy = pad(torch.where(real, -(logp.exp() * logp).sum(-1), 0.0), (1, 0))
    mb = dict(batch.tensors, old_logprobs=logprobs.detach())
    loss, metrics = actor_loss(ALGO, logprobs, entropy, mb, batch["loss_mask"].sum().item(), len(batch))
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())).item()
    torch.optim.Adam(model.parameters(), lr=LR).step()
    metrics = {k: v.item() for k, v in metrics.items()} | {"loss": loss.item()}
    return metrics, grad_norm, {n: p.detach() for n, p in model.state_dict().items()}


def test_train_step_matches_a_single_process_reference(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    ref_logprobs, _ = hf_logprobs_entropy(model_dir, rl_batch())
    ref_metrics, ref_grad_norm, ref_weights = _hf_reference_step(model_dir)
    results = run_distributed(_train_rank, 2, model_dir, ref_logprobs, tp=2)

    for layout in LAYOUTS:
        metrics, weights, version = results[layout]
        assert version == 1
        assert metrics["lr"] == LR
        for name in ("loss", "pg_loss", "kl", "entropy", "clipfrac"):
            assert abs(metrics[name] - ref_metrics[name]) < 1e-5 * max(1.0, abs(ref_metrics[name])), (layout, name)
        # Adam's first step is nearly sign(grad): the norm pins the gradient's scale.
        assert abs(metrics["grad_norm"] - ref_grad_norm) < 1e-5 * ref_grad_norm, layout
        assert sorted(weights) == sorted(n for n in ref_weights if n != "lm_head.weight")
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, ref_weights[name], rtol=0, atol=1e-5, msg=f"{layout} {name}")

    policy, version, sft = results["schedule"]
    assert version == 2 * 2 + 4 * 2  # 2 mini-batches x 2 epochs, then 4 SFT calls of 2 mini-batches
    assert abs(policy["lr"] - 1e-3 / 2) < 1e-12  # warmup step 1 of 2
    assert all(s["lr"] == 3e-2 for s in sft)
    losses = [s["loss"] for s in sft]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def _bf16_logits_rank(rank, model_dir):
    from megarl.engine import MegatronEngine, megatron_engine

    real_kernel, seen = megatron_engine.vocab_parallel_logprobs, []

    def spy(logits, *args, **kwargs):
        seen.append(logits.dtype)
        return real_kernel(logits, *args, **kwargs)

    megatron_engine.vocab_parallel_logprobs = spy
    runs = {}
    for upcast in (True, False):  # Float16Module's float32 logits (megatron's default), then the engine's own
        engine = MegatronEngine(model_dir, ActorConfig(precision="bf16", fp32_lm_head=False, micro_batch_size=2), ALGO,
                                "cpu", 1, 10)
        engine._forward_kwargs = {} if upcast else engine._forward_kwargs
        seen.clear()
        batch = rl_batch()
        batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
        metrics = engine.train(batch, loss="policy")
        weights = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
        runs[upcast] = (set(seen), batch["old_logprobs"], metrics, weights)
    return runs


def test_bf16_logits_reach_the_logprob_kernel_without_a_float32_copy(tmp_path):
    """A bf16 engine with the bf16 LM head (actor.fp32_lm_head=false) hands the LM head's logits to the log-prob
    kernel in bf16 (the float32 copy Float16Module makes by default is the size of the logits, twice over with its
    gradient), to the same log-probs, metrics and updated weights, bit for bit."""
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    runs = run_distributed(_bf16_logits_rank, 1, model_dir)
    (up_dtypes, up_logprobs, up_metrics, up_weights), (dtypes, logprobs, metrics, weights) = runs[True], runs[False]
    assert up_dtypes == {torch.float32} and dtypes == {torch.bfloat16}
    assert torch.equal(logprobs, up_logprobs)
    assert metrics == up_metrics
    assert all(torch.equal(weights[n], up_weights[n]) for n in up_weights)
