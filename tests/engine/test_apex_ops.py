"""megarl's stand-ins for apex's ops in megatron (engine/apex_ops.py): the optimizer's multi-tensor ops compute what
megatron's Python loops compute, and gradient-accumulation fusion (the weight gradients' GEMMs adding into the
float32 main_grad) trains to the same weights as megatron's unfused path, tied embeddings included."""

import dataclasses

import torch

from megarl.config import ActorConfig, OptimConfig
from megarl.engine import apex_ops
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir
from tests.engine.test_megatron_train import ALGO, rl_batch
from tests.models.hf_families import deepseek_v3_config, save_random


def test_multi_tensor_ops_compute_what_megatrons_loops_compute():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g) for shape in ((7, 5), (11,), (3, 4, 2), (1,))]
    norm, per_tensor = apex_ops.multi_tensor_l2norm(0, None, [tensors], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(norm[0], torch.cat([t.flatten() for t in tensors]).norm(), rtol=1e-6, atol=0)
    _, per_tensor = apex_ops.multi_tensor_l2norm(0, None, [tensors], True)
    torch.testing.assert_close(per_tensor, torch.stack([t.norm() for t in tensors]))

    # The main parameters into the bf16 model (scale 1), gradients clipped in place (one list twice), and a copy
    # with a scale: each target holds source x scale in its own dtype, sources untouched.
    model = [torch.zeros_like(t, dtype=torch.bfloat16) for t in tensors]
    apex_ops.multi_tensor_scale(0, None, [tensors, model], 1.0)
    assert all(torch.equal(m, t.to(torch.bfloat16)) for m, t in zip(model, tensors))
    grads = [t.clone() for t in tensors]
    apex_ops.multi_tensor_scale(0, None, [grads, grads], 0.25)
    assert all(torch.equal(c, t * 0.25) for c, t in zip(grads, tensors))
    scaled = [torch.empty_like(t) for t in tensors]
    apex_ops.multi_tensor_scale(0, None, [tensors, scaled], 3.0)
    assert all(torch.equal(s, t * 3.0) for s, t in zip(scaled, tensors))


def test_wgrad_accumulation_adds_the_product_into_main_grad():
    g = torch.Generator().manual_seed(1)
    total_input, grad_output = torch.randn(9, 6, generator=g), torch.randn(9, 4, generator=g)
    main_grad = torch.randn(4, 6, generator=g)
    expected = main_grad + grad_output.t() @ total_input
    apex_ops.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    torch.testing.assert_close(main_grad, expected)
    assert apex_ops.wgrad_fusion_available("cpu", torch.float32)
    assert not apex_ops.wgrad_fusion_available("cpu", torch.bfloat16)  # the CPU keeps megatron's path in bf16


def _fusion_rank(rank, model_dir, tp=1, ep=1, etp=None):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers

    from megarl.config import ParallelConfig
    from megarl.engine import MegatronEngine, megatron_engine
    from tests.models.test_deepseek_moe import _relayout

    unfused = megatron_engine.with_fused_kernels
    runs = {}
    for fused in (False, True):  # on the CPU only the fusion itself: the other fused kernels are GPU-only
        megatron_engine.with_fused_kernels = (
            (lambda config, actor, device: dataclasses.replace(config, gradient_accumulation_fusion=True))
            if fused else unfused)
        _relayout(tp, ep, etp)
        # clip_grad low enough to clip every step: the grad norm and the in-place scale both run
        actor = ActorConfig(parallel=ParallelConfig(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=etp or 0,
                                                    sequence_parallel=tp > 1),
                            micro_batch_size=2, optim=OptimConfig(lr=1e-2, clip_grad=0.05))
        engine = MegatronEngine(model_dir, actor, ALGO, "cpu", 1, 10)
        assert engine.gpt.config.gradient_accumulation_fusion == fused
        calls = []
        if fused:
            accumulate = layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32
            layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = (
                lambda *args: calls.append(args[2].shape) or accumulate(*args))
        metrics = []
        for _ in range(2):
            batch = rl_batch()
            batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
            metrics.append(engine.train(batch, loss="policy"))
        weights = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
        runs[fused] = metrics, weights, len(calls)
    return runs


def _assert_same_training(runs):
    (plain_metrics, plain_weights, _), (metrics, weights, calls) = runs[False], runs[True]
    for step, (plain, fused) in enumerate(zip(plain_metrics, metrics)):
        assert plain["grad_norm"] > 0.05 * 10, "the test wants every step clipped"
        for name in ("loss", "grad_norm"):
            assert abs(plain[name] - fused[name]) < 1e-5 * abs(plain[name]), (step, name, plain[name], fused[name])
    assert sorted(weights) == sorted(plain_weights)
    for name, tensor in weights.items():
        # ~1e-7 apart; Adam's step (lr 1e-2) magnifies a rounding of the sum into its smallest gradients to ~2e-6
        torch.testing.assert_close(tensor, plain_weights[name], rtol=0, atol=1e-5, msg=name)
    return calls


def test_gradient_accumulation_fusion_trains_to_megatrons_weights(tmp_path):
    """Two policy steps of 4 micro-batches each, tied embeddings (the LM head's GEMM and the embedding's gradient
    meet in one main_grad, which megatron zeroes the dummy gradient for): the same losses, grad norms and
    weights, to float32 rounding, as megatron's unfused path."""
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    calls = _assert_same_training(run_distributed(_fusion_rank, 1, model_dir))
    assert calls == 2 * 4 * (2 * 4 + 1), calls  # 2 steps x 4 micro-batches x (2 layers x 4 linears + the LM head)


def test_gradient_accumulation_fusion_at_tp2_ep2_with_deepseek_v3_layers(tmp_path):
    """The same on two ranks at TP=2 (sequence parallel, as megatron wants with MoE) with the experts at EP=2
    (expert TP 1), a DeepSeek-V3 shape: column- and row-parallel linears split over TP, multi-latent attention's
    projections, each EP rank's experts and the shared expert."""
    model_dir = save_random(deepseek_v3_config(layers=2, first_k_dense_replace=1), tmp_path / "v3", seed=3)
    calls = _assert_same_training(run_distributed(_fusion_rank, 2, model_dir, 2, 2, 1, tp=2, timeout=400))
    assert calls > 0
