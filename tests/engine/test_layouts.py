"""Uneven pipeline stages (actor.parallel.pp_first_stage_layers / pp_last_stage_layers) on 2 gloo ranks: a
3-layer Qwen2 (tied embeddings: the output layer's copy lives on the last stage) split 1+2 and 2+1 over PP=2.

Log-probs at 1+2 equal transformers'; two policy steps at 1+2 give PP=1's losses and weights; a dist checkpoint
written at 1+2 after step 1 resumes at PP=1 (DP=2) and at 2+1 with the weights it was written with and step 2's
loss (the Adam state came along). A 3-layer DeepSeek-V3 (layer 0 dense, 1-2 mixture of experts) split 1+2,
its dense layer alone on the first stage, gives transformers' log-probs and exports its checkpoint bitwise.
"""

from pathlib import Path

import torch

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch
from tests.models.hf_families import deepseek_v3_config, save_random

ALGO = AlgorithmConfig(kl_coef=0.0)
# (pp, first, last) on 2 ranks
PP1, FIRST_1, LAST_1 = (1, 0, 0), (2, 1, 0), (2, 0, 1)


def rl_batch(step: int):
    batch = padded_batch(rows=8, seed=step)
    g = torch.Generator().manual_seed(100 + step)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=g) * batch["loss_mask"]
    return batch


def engine_at(model_dir, layout):
    from megatron.core import parallel_state as ps

    from megarl.engine import MegatronEngine
    from megarl.parallel.state import build_model_parallel

    pp, first, last = layout
    ps.destroy_model_parallel()
    build_model_parallel(1, pp, seed=1)
    parallel = ParallelConfig(world_size=2, pp=pp, pp_first_stage_layers=first, pp_last_stage_layers=last)
    actor = ActorConfig(parallel=parallel, micro_batch_size=2, optim=OptimConfig(lr=1e-2, clip_grad=1.0))
    return MegatronEngine(model_dir, actor, ALGO, "cpu", 1, 10)


def rl_step(engine, step: int) -> float:
    from megatron.core import parallel_state as ps

    batch = rl_batch(step)
    batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
    return engine.train(batch.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()])["loss"]


def exported(engine) -> dict:
    return {name: t for bucket in engine.export_hf_weights(1 << 30) for name, t in bucket}


def _uneven_rank(rank, model_dir, checkpoint, deepseek_dir):
    from safetensors.torch import load_file

    engine = engine_at(deepseek_dir, FIRST_1)
    exported_deepseek, checkpoint_deepseek = exported(engine), load_file(f"{deepseek_dir}/model.safetensors")
    bitwise = sorted(exported_deepseek) == sorted(checkpoint_deepseek) and all(
        torch.equal(exported_deepseek[k], t) for k, t in checkpoint_deepseek.items())
    out = {"deepseek": (engine.compute_logprobs(padded_batch())["logprobs"], bitwise)}
    engine = engine_at(model_dir, FIRST_1)
    out["stages"] = [sorted(l for l, s in engine.layout.layer_stage.items() if s == stage) for stage in (0, 1)]
    out["logprobs"] = engine.compute_logprobs(padded_batch())["logprobs"]
    losses = [rl_step(engine, 1)]
    out["after step 1"] = exported(engine)
    engine.save_checkpoint(checkpoint)
    losses.append(rl_step(engine, 2))
    out[FIRST_1] = (losses, exported(engine))

    engine = engine_at(model_dir, PP1)
    out[PP1] = ([rl_step(engine, 1), rl_step(engine, 2)], exported(engine))

    for layout in (PP1, LAST_1):
        engine = engine_at(model_dir, layout)
        engine.load_checkpoint(checkpoint)
        out[("resumed", layout)] = (exported(engine), rl_step(engine, 2))
    return out


def test_uneven_pipeline_stages_train_and_resume_at_other_layouts(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True, layers=3)
    ref_logprobs, _ = hf_logprobs_entropy(model_dir, padded_batch())
    deepseek_dir = save_random(deepseek_v3_config(layers=3, first_k_dense_replace=1), tmp_path / "v3", seed=2)
    deepseek_logprobs, _ = hf_logprobs_entropy(deepseek_dir, padded_batch())

    out = run_distributed(_uneven_rank, 2, model_dir, str(tmp_path / "ckpt"), deepseek_dir, timeout=240)

    assert out["stages"] == [[0], [1, 2]]
    torch.testing.assert_close(out["deepseek"][0], deepseek_logprobs, rtol=0, atol=1e-5)
    assert out["deepseek"][1]
    torch.testing.assert_close(out["logprobs"], ref_logprobs, rtol=0, atol=1e-5)
    (losses, weights), (ref_losses, ref_weights) = out[FIRST_1], out[PP1]
    assert losses[0] != losses[1]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
    assert sorted(weights) == sorted(ref_weights)
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)
    for layout in (PP1, LAST_1):
        resumed_weights, loss = out[("resumed", layout)]
        for name, tensor in out["after step 1"].items():
            assert torch.equal(resumed_weights[name], tensor), (layout, name)
        torch.testing.assert_close(loss, losses[1], rtol=0, atol=1e-5, msg=str(layout))
    assert Path(tmp_path / "ckpt" / "engine.json").exists()
