"""Context parallelism (CP) without TransformerEngine (megarl/engine/context_parallel.py), padded and packed
rows, against transformers on the same checkpoints: Qwen2 (q/k/v biases, tied) and Qwen3 (QK-norm, head_dim
16 != hidden/heads, untied), both GQA.

Per layout: log-probs and entropy equal transformers' (float32), a value head on Qwen2 (a frozen critic /
reward model with a random head) gives transformers' token-classification values, and one SFT Adam step on
Qwen3 gives
transformers' loss, grad norm and updated weights: the CP ranks' gradients sum to the whole rows' gradient
once, neither CP times (an output gather whose backward sums over CP instead of slicing) nor partially.
After the step the weight sync (megarl.reshard, CP ranks counted as replicas) delivers the trained
weights. Layouts: CP=2 on 2 ranks (rows padded to a multiple of 2 * CP = 4); CP=2 x TP=2 with sequence
parallelism (rows padded from 12 to 16), CP=2 x DP=2, and CP=2 x PP=2 with virtual stages on 4 ranks.
RL training over several steps (test_checkpoint.py's run: PPO epochs, KL, clipping, distributed optimizer) at
CP=2 follows DP=2's loss curve, and a CP=2 checkpoint resumes at DP=2.
"""

from pathlib import Path


import pytest
import torch

from megarl.config import ActorConfig, AlgorithmConfig, CriticConfig, OptimConfig, ParallelConfig
from megarl.engine.attention import resolve_core_attention
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch
from tests.models.hf_families import qwen3_config, save_random
from tests.engine.test_checkpoint import SAVE_AFTER, STEPS, run
from tests.engine.test_roles import _hf_values
from tests.models.test_families_vs_hf import ADAM_EPS, LR, _assert_like_hf_step, _exported, _hf_sft_step

BUDGET = 24  # tokens per packed micro-batch: two rows of the longest sequence (12)
LAYERS = 4  # PP=2 x VPP=2: one layer per virtual stage


def _relayout(tp, pp, cp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1)


def _synced(engine, rank) -> dict:
    """What the weight sync delivers to generation rank `rank` (full HF tensors, generation TP=2)."""
    from megarl.reshard.resharder import engine_resharder

    buckets = engine_resharder(engine, rank).buckets(2, "full", 1 << 30, engine.params_dtype)
    return {name: t for bucket in buckets for name, t in bucket}


def _value_outputs(model_dir, parallel) -> dict:
    """A frozen value-head engine on the checkpoint with a random head: values, rewards, exported weights."""
    from megarl.engine import MegatronEngine

    critic = MegatronEngine(model_dir, CriticConfig(parallel=parallel, micro_batch_size=2), AlgorithmConfig(),
                            "cpu", 1, 10, head="value", trainable=False)
    with torch.no_grad():
        for gpt in critic.gpts:
            if gpt.post_process:  # the same head on every rank of the last stage
                gpt.output_layer.weight.copy_(torch.randn(gpt.output_layer.weight.shape,
                                                          generator=torch.Generator().manual_seed(0)))
    return {"values": critic.compute_values(padded_batch())["values"],
            "rewards": critic.compute_rewards(padded_batch())["rewards"], "weights": _exported(critic)}


def _cp_rank(rank, cases, layouts, train_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.engine import MegatronEngine

    trained, valued = {}, {}
    for layout in layouts:
        tp, pp, vpp, cp, sp, max_tokens = layout
        _relayout(tp, pp, cp)
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sp)
        actor = ActorConfig(parallel=parallel, micro_batch_size=2, max_tokens_per_micro_batch=max_tokens,
                            optim=OptimConfig(lr=LR, adam_eps=ADAM_EPS, clip_grad=0.0))
        for name, model_dir, ref_logprobs, ref_entropy in cases:
            engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10, trainable=False)
            assert engine.core_attention == "sdpa" and engine.gpt.config.context_parallel_size == cp
            out = engine.compute_logprobs(padded_batch(), with_entropy=True)
            where = f"{name} at {layout}"
            # 2e-5: the default one_row layout's 24-wide rows sum in another order (1.05e-5 seen, rows < 2e-6)
            torch.testing.assert_close(out["logprobs"], ref_logprobs, rtol=0, atol=2e-5, msg=where)
            torch.testing.assert_close(out["entropy"], ref_entropy, rtol=0, atol=1e-5, msg=where)
        valued[layout] = _value_outputs(cases[0][1], parallel)

        engine = MegatronEngine(train_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        share = padded_batch(rows=8).chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
        metrics, exported = engine.train(share, loss="sft"), _exported(engine)
        if vpp == 1:  # the weight sync's own layouts (with virtual stages it falls back to the export)
            synced = _synced(engine, rank)
            assert sorted(synced) == sorted(exported) and all(torch.equal(synced[k], exported[k]) for k in synced)
        trained[layout] = (metrics, exported)
    return trained, valued


def _cases(tmp_path):
    qwen3 = qwen3_config(tied=False)
    qwen3.num_hidden_layers, qwen3.layer_types = LAYERS, ["full_attention"] * LAYERS
    dirs = {"qwen2": make_qwen2_dir(tmp_path / "qwen2", tied=True, layers=LAYERS),
            "qwen3": save_random(qwen3, tmp_path / "qwen3", seed=2)}
    return [(name, d, *hf_logprobs_entropy(d, padded_batch())) for name, d in dirs.items()]


def _check(tmp_path, world_size, layouts):
    cases = _cases(tmp_path)
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(cases[1][1], tmp_path / "hf-step")
    trained, valued = run_distributed(_cp_rank, world_size, cases, layouts, cases[1][1], timeout=240)
    assert sorted(trained) == sorted(valued) == sorted(layouts)
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)
    batch = padded_batch()
    real, last = batch["attention_mask"][:, 1:] > 0, batch["attention_mask"].sum(1) - 1
    for layout, out in valued.items():
        hf = _hf_values(cases[0][1], out["weights"], batch)  # V(tokens[<t]) is the head at position t-1
        assert hf.abs().max() > 1  # the random head makes values far from 0
        torch.testing.assert_close(out["values"][:, 1:][real], hf[:, :-1][real], rtol=0, atol=1e-4, msg=str(layout))
        torch.testing.assert_close(out["rewards"], hf[torch.arange(len(batch)), last], rtol=0, atol=1e-4,
                                   msg=str(layout))


def test_context_parallel_padded_and_packed_match_transformers(tmp_path):
    # (tp, pp, vpp, cp, sequence_parallel, max_tokens_per_micro_batch)
    _check(tmp_path, 2, [(1, 1, 1, 2, False, 0), (1, 1, 1, 2, False, BUDGET)])


def test_context_parallel_with_tensor_sequence_and_data_parallel(tmp_path):
    _check(tmp_path, 4, [(2, 1, 1, 2, True, BUDGET), (1, 1, 1, 2, False, BUDGET), (1, 2, 2, 2, False, BUDGET)])


def test_context_parallel_runs_sdpa_only():
    assert resolve_core_attention("auto", "cpu", 2) == resolve_core_attention("auto", "cuda", 2) == "sdpa"
    for name in ("local", "varlen"):
        with pytest.raises(ValueError, match=rf"attention='{name}' does not run context parallelism \(cp=2\)"):
            resolve_core_attention(name, "cpu", 2)


def _resume_rank(rank, model_dir, root):
    return {"dp2": run(model_dir, 1, 1, True), "cp2": run(model_dir, 1, 1, True, save_to=Path(root) / "cp2", cp=2),
            "cp2 -> dp2": run(model_dir, 1, 1, True, resume_from=Path(root) / "cp2")}


def test_context_parallel_rl_steps_and_checkpoint_follow_data_parallel(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    r = run_distributed(_resume_rank, 2, model_dir, str(tmp_path / "ckpt"))
    (dp2, lr), tail = r["dp2"], slice(SAVE_AFTER, STEPS)
    assert len(set(dp2)) == STEPS
    torch.testing.assert_close(r["cp2"][0], dp2, rtol=0, atol=1e-5)
    torch.testing.assert_close(r["cp2 -> dp2"][0], dp2[tail], rtol=0, atol=1e-5)
    assert r["cp2"][1] == r["cp2 -> dp2"][1] == lr
