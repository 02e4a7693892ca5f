"""DeepSeekMoE in the whole model on megatron against transformers: tiny random DeepSeek-V3 (sigmoid router with a
random non-zero e_score_correction_bias, topk 3 != 2 x topk_group) and DeepSeek-V2 (softmax, greedy) checkpoints, a
dense first layer and MoE layers after it, at TP=1, EP=2, ETP=2 (DP=2), TP=2 and TP=2 x EP=2 with whole experts (ETP=1) on 2 gloo
ranks (V2 at the last two): log-probs and entropy equal transformers' (fp32), exported weights bitwise the
checkpoint's; and a DeepSeek-V3 of Kimi-K2's routing shape (one group of many experts) at EP=2.
And the aux-loss-free bias update (actor.moe_router_bias_update_rate), at EP=2 and at TP=2 with sequence parallelism:
off, a training step leaves the bias as it was; on, it moves each expert's bias by the rate towards even load, as
the logged per-expert loads say, and the exported e_score_correction_bias (what SGLang receives) carries it."""

import torch
from safetensors.torch import load_file

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import DEEPSEEK_YARN, deepseek_v2_config, deepseek_v3_config, save_random

# (tp, ep, etp) on 2 ranks; etp None = tp; (1, 1, 2): experts split over the expert-TP group of two data-parallel
# ranks. DeepSeek-V2 (its MoE differs only in the routing rule) at the last two, Kimi-K2's routing shape at EP=2.
LAYOUTS = ((1, 1, None), (1, 2, None), (1, 1, 2), (2, 1, None), (2, 2, 1))
ONLY_AT = {"deepseek-v2": LAYOUTS[3:], "kimi-k2": ((1, 2, None),)}
TOPK = 3  # num_experts_per_tok of hf_families' DeepSeek configs
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"


def _relayout(tp, ep, etp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(1)


def _engine(model_dir, tp, ep, etp=None, sequence_parallel=False, **actor):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine

    parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, ep=ep, etp=etp or 0,
                              sequence_parallel=sequence_parallel)
    return MegatronEngine(model_dir, ActorConfig(parallel=parallel, micro_batch_size=2, **actor), AlgorithmConfig(),
                          "cpu", 1, 10)


def _exported(engine) -> dict:
    return {name: t.clone() for bucket in engine.export_hf_weights(1 << 30) for name, t in bucket}


def _check_layouts(rank, cases):
    for tp, ep, etp in LAYOUTS:
        _relayout(tp, ep, etp)
        for name, model_dir, ref_logprobs, ref_entropy in cases:
            if (tp, ep, etp) not in ONLY_AT.get(name, LAYOUTS):
                continue
            engine = _engine(model_dir, tp, ep, etp)
            out = engine.compute_logprobs(padded_batch(), with_entropy=True)
            where = f"{name} at tp={tp} ep={ep} etp={etp}"
            torch.testing.assert_close(out["logprobs"], ref_logprobs, rtol=0, atol=1e-5, msg=where)
            torch.testing.assert_close(out["entropy"], ref_entropy, rtol=0, atol=1e-5, msg=where)
            exported, checkpoint = _exported(engine), load_file(f"{model_dir}/model.safetensors")
            assert sorted(exported) == sorted(checkpoint), where
            for key, tensor in checkpoint.items():
                assert torch.equal(exported[key], tensor), (where, key)


def test_deepseek_moe_matches_transformers_at_tp_ep_etp(tmp_path):
    configs = {"deepseek-v3": deepseek_v3_config(layers=3, first_k_dense_replace=1),
               "deepseek-v2": deepseek_v2_config(layers=2, first_k_dense_replace=1),
               # Kimi-K2's routing (configs/models/kimi-k2.json): every expert in one group (n_group = topk_group =
               # 1), many experts per choice (16 for top 2; Kimi: 384 for top 8), and its YaRN (beta_fast =
               # beta_slow = mscale = mscale_all_dim = 1)
               "kimi-k2": deepseek_v3_config(layers=2, first_k_dense_replace=1, n_routed_experts=16,
                                             num_experts_per_tok=2, n_group=1, topk_group=1,
                                             routed_scaling_factor=2.827,
                                             rope_parameters=dict(DEEPSEEK_YARN, beta_fast=1.0, beta_slow=1.0,
                                                                  mscale_all_dim=1.0))}
    cases = []
    for seed, (name, config) in enumerate(configs.items()):
        model_dir = save_random(config, tmp_path / name, seed=seed)
        cases.append((name, model_dir, *hf_logprobs_entropy(model_dir, padded_batch())))
    assert load_file(f"{cases[0][1]}/model.safetensors")[BIAS.format(1)].abs().min() > 0

    run_distributed(_check_layouts, 2, cases, timeout=300)


def _train_steps(rank, model_dir, runs):
    """One SFT step from the checkpoint per (tp, ep, rate); TP=2 with sequence parallelism (each TP rank routes
    its slice of the tokens): (metrics, exported weights)."""
    from megatron.core import parallel_state as ps

    results = []
    for tp, ep, rate in runs:
        _relayout(tp, ep, None)
        batch = padded_batch(rows=8)
        share = batch.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
        engine = _engine(model_dir, tp, ep, optim=OptimConfig(lr=1e-2, clip_grad=0.0), moe_router_bias_update_rate=rate,
                         sequence_parallel=tp > 1)
        results.append((engine.train(share, loss="sft"), _exported(engine)))
    return results


def test_expert_bias_moves_towards_even_load_only_when_the_update_is_on(tmp_path):
    model_dir = save_random(deepseek_v3_config(layers=3, first_k_dense_replace=1), tmp_path / "v3", seed=3)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    experts = checkpoint[BIAS.format(1)].numel()
    runs = ((1, 2, 0.0), (1, 2, 0.01), (2, 1, 0.01))  # (tp, ep, rate)

    results = run_distributed(_train_steps, 2, model_dir, runs, timeout=300)

    for (_, _, rate), (metrics, exported) in zip(runs, results):
        routed = None
        for layer in (1, 2):  # the MoE layers (layer 0 is dense)
            load = torch.tensor([metrics[f"expert_load/layer_{layer}/expert_{e}"] for e in range(experts)])
            routed = load.sum() if routed is None else routed
            assert load.sum() == routed and routed % TOPK == 0 and routed > 0  # every token to topk experts
            bias, before = exported[BIAS.format(layer)], checkpoint[BIAS.format(layer)]
            # megatron's rule: each expert's bias up by the rate if it had less than the mean load, down if more
            expected = before + torch.sign(load.mean() - load).float() * rate
            assert torch.equal(bias, expected), (rate, layer)
            assert (bias != before).any() == (rate > 0), rate
        assert "expert_load/layer_0/expert_0" not in metrics and metrics["expert_load/max_over_mean"] > 1
        gate = "model.layers.1.mlp.gate.weight"
        assert not torch.equal(exported[gate], checkpoint[gate])  # the router trained either way
