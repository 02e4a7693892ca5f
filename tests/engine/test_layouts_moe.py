"""Expert-tensor parallelism (actor.parallel.etp), MoE activation recompute (actor.recompute_modules) and uneven
pipeline stages with experts, on a 3-layer Qwen3-MoE in one 4-rank gloo job:

- TP=2, EP=2, ETP=1 (whole experts beside TP-split attention, sequence parallel);
- TP=1, EP=2, ETP=2 (each expert split over two ranks of a data-parallel group), once without recompute and
  once recomputing the MoE layers and core attention in the backward pass;
- PP=2 split 1+2 with EP=2.

At each: log-probs equal transformers', the weights exported back to HF names are bitwise the checkpoint's, and
one SFT Adam step gives the loss, grad norm and weights of a single-process transformers + torch Adam step.
"""

import torch

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import qwen3_moe_config, save_random
from tests.models.test_families_vs_hf import ADAM_EPS, LR, _assert_like_hf_step, _hf_sft_step

MOE_RECOMPUTE = ["moe", "core_attn"]
# (tp, ep, etp, sequence_parallel, pp, first stage layers, recompute modules)
LAYOUTS = ((2, 2, 1, True, 1, 0, ()), (1, 2, 2, False, 1, 0, ()), (1, 2, 2, False, 1, 0, tuple(MOE_RECOMPUTE)),
           (1, 2, 0, False, 2, 1, ()))


def _moe_rank(rank, model_dir):
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from megarl.engine import MegatronEngine
    from megarl.parallel.state import build_model_parallel

    out = {}
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    for tp, ep, etp, sp, pp, first, recompute in LAYOUTS:
        ps.destroy_model_parallel()
        build_model_parallel(tp, pp, seed=1, ep=ep, etp=etp or None)
        parallel = ParallelConfig(world_size=4, tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=sp,
                                  pp_first_stage_layers=first)
        actor = ActorConfig(parallel=parallel, micro_batch_size=2, recompute="selective" if recompute else "none",
                            recompute_modules=list(recompute), optim=OptimConfig(lr=LR, adam_eps=ADAM_EPS, clip_grad=0.0))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        assert ps.get_expert_tensor_parallel_world_size() == (etp or tp)
        assert engine.gpt.config.recompute_modules == (list(recompute) or ["core_attn"])
        logprobs = engine.compute_logprobs(padded_batch())["logprobs"]
        exported = {name: t for bucket in engine.export_hf_weights(1 << 30) for name, t in bucket}
        bitwise = sorted(exported) == sorted(checkpoint) and all(torch.equal(exported[k], t)
                                                                 for k, t in checkpoint.items())
        batch = padded_batch(rows=8)
        metrics = engine.train(batch.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()], loss="sft")
        trained = {name: t for bucket in engine.export_hf_weights(1 << 30) for name, t in bucket}
        out[(tp, ep, etp, pp, first, recompute)] = (logprobs, bitwise, metrics, trained)
    return out


def test_qwen3_moe_at_etp_recompute_and_uneven_pp_matches_transformers(tmp_path):
    config = qwen3_moe_config(tied=False, norm_topk_prob=True)
    config.num_hidden_layers = 3
    model_dir = save_random(config, tmp_path / "moe", seed=7)
    ref_logprobs, _ = hf_logprobs_entropy(model_dir, padded_batch())
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(model_dir, tmp_path / "hf-step")

    out = run_distributed(_moe_rank, 4, model_dir, timeout=300)

    assert len(out) == len(LAYOUTS)
    for layout, (logprobs, bitwise, _, _) in out.items():
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5, msg=str(layout))
        assert bitwise, layout
    _assert_like_hf_step({layout: (metrics, weights) for layout, (_, _, metrics, weights) in out.items()},
                         ref_loss, ref_grad_norm, ref_weights)
