"""Qwen3.5 (hybrid linear / gated full attention) on megatron against transformers' own classes, on the CPU.

- The torch fallbacks (models/gated_delta_net.py) equal transformers' torch gated delta rule (chunked and recurrent)
  and nn.Conv1d, each packed sequence as if alone.
- One 2-rank gloo job at DP=2 (packed rows by the block-causal mask, and by cu_seqlens under attention=varlen) and at
  PP=2: log-probs and entropy equal transformers' (float32), the exported weights are bitwise the checkpoint's,
  and (mask and PP=2) one SFT Adam step gives transformers' loss, grad norm and weights.
- The weight maps and the resharder's inventory name every checkpoint tensor once, with its shape; TP=2 shards put
  back together bitwise; the planner sizes the model from the inventory and its KV cache from the full-attention
  layers only.
- TP=2, with and without sequence parallelism (and Qwen3-Next's at TP=2 with SP): log-probs and one SFT step as
  transformers'; a TP that does not divide the linear-attention key heads is refused by name. GRPO at TP=2: the sync
  gathers in_proj_qkv and conv1d (q, k and v each cut by heads) into the HF order.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule

from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
from megarl.models import get_family
from megarl.models.gated_delta_net import l2norm, recurrent_gated_delta_rule, segmented_causal_conv1d, sequence_starts
from megarl.models.qwen3_5 import FAMILY as qwen3_5
from megarl.reshard.inventory import hf_inventory
from megarl.reshard.plan import kv_bytes_per_token, main
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import qwen3_5_config, save_random
from tests.models.test_family_mapping import assert_names_and_tp2_shards
from tests.models.test_families_vs_hf import _assert_like_hf_step, _hf_sft_step, assert_like_hf, sft_step

# (tp, pp, attention) on 2 ranks: DP=2 with packed rows (local: block-causal mask; varlen: cu_seqlens), PP=2
LAYOUTS = ((1, 1, "local"), (1, 1, "varlen"), (1, 2, "local"))


def _rule_inputs(rows=2, length=70, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(rows, length, heads, 8, generator=g), torch.randn(rows, length, heads, 8, generator=g)
    v = torch.randn(rows, length, heads, 12, generator=g)
    decay = -0.5 * torch.rand(rows, length, heads, generator=g)
    return q, k, v, decay, torch.rand(rows, length, heads, generator=g)


def test_recurrent_rule_equals_transformers_chunked_and_recurrent_rules():
    q, k, v, decay, beta = _rule_inputs()  # 70 tokens: two of transformers' 64-token chunks
    starts = torch.zeros(2, 70, dtype=torch.bool)
    starts[:, 0] = True
    ours = recurrent_gated_delta_rule(l2norm(q), l2norm(k), v, decay, beta, starts)
    chunked, _ = torch_chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)
    recurrent, _ = torch_recurrent_gated_delta_rule(q, k, v, decay, beta, None, False, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, chunked, rtol=0, atol=2e-6)
    torch.testing.assert_close(ours, recurrent, rtol=0, atol=2e-6)


def test_packed_sequences_restart_the_rule_and_the_convolution():
    q, k, v, decay, beta = _rule_inputs(length=20, seed=1)
    bounds = {0: [0, 7, 20], 1: [0, 1, 12, 20]}
    starts = torch.zeros(2, 20, dtype=torch.bool)
    for row, b in bounds.items():
        starts[row, b[:-1]] = True
    ours = recurrent_gated_delta_rule(l2norm(q), l2norm(k), v, decay, beta, starts)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=False)
    x = torch.randn(2, 6, 20)
    convolved = segmented_causal_conv1d(x, conv.weight, None, starts.long().cumsum(1))
    for row, b in bounds.items():
        for lo, hi in zip(b[:-1], b[1:]):
            alone, _ = torch_chunk_gated_delta_rule(*(t[row:row + 1, lo:hi] for t in (q, k, v, decay, beta)),
                                                    use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(ours[row:row + 1, lo:hi], alone, rtol=0, atol=2e-6)
            torch.testing.assert_close(convolved[row:row + 1, :, lo:hi], conv(x[row:row + 1, :, lo:hi])[..., :hi - lo],
                                       rtol=0, atol=1e-6)


def test_sequence_starts_from_the_block_causal_mask_and_from_cu_seqlens():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.engine.packing import block_causal_mask

    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0], [3, 4, 4, 4, 0, 0]])  # 0: padding
    expected = torch.tensor([[1, 0, 0, 1, 0, 1], [1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(sequence_starts(block_causal_mask(doc_ids), None, 2, 6, "cpu"), expected)
    # over the rows flattened; each row starts one, and the padding past the last sequence (10, 11) none
    cu = torch.tensor([0, 3, 5, 7, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    assert torch.equal(sequence_starts(None, params, 2, 6, "cpu"),
                       torch.tensor([[1, 0, 0, 1, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool))


@pytest.mark.parametrize("tied", [True, False])
def test_weight_maps_and_inventory_are_the_checkpoints_and_tp2_shards_round_trip(tied, tmp_path):
    # transformers' default layer_types at 4 layers: linear, linear, linear, full
    config = qwen3_5_config(num_hidden_layers=4, layer_types=None, tie_word_embeddings=tied)
    hf = config.to_dict()
    assert get_family(hf) is qwen3_5 and get_family({"model_type": "qwen3_5_text"}) is qwen3_5
    save_random(config, tmp_path)
    saved = load_file(f"{tmp_path}/model.safetensors")
    assert_names_and_tp2_shards(qwen3_5, hf, saved)


def test_planner_counts_the_checkpoint_and_caches_keys_in_full_attention_layers_only(tmp_path, capsys):
    config = qwen3_5_config(num_hidden_layers=4, layer_types=None)
    save_random(config, tmp_path)
    params = sum(t.numel() for t in load_file(f"{tmp_path}/model.safetensors").values())
    assert sum(s.numel for s in hf_inventory(config.to_dict())) == params
    assert kv_bytes_per_token(config.to_dict(), 1) == 1 * 2 * 2 * 16 * 2  # 1 full layer x (K, V) x 2 heads x 16 x bf16
    main(["--model", f"{tmp_path}/config.json", "--train", "tp=1,pp=2,dp=1", "--gen", "tp=2"])
    out = capsys.readouterr().out
    assert "pipeline stages (decoder layers): 2,2" in out and "actor.parallel.pp=2" in out


def test_tensor_parallelism_must_divide_the_linear_key_heads():
    from megarl.utils.hf_config import parallel_limit

    hf = qwen3_5_config(linear_num_key_heads=1, linear_num_value_heads=2).to_dict()
    assert "TP must divide linear_num_key_heads=1" in parallel_limit(hf, 2, 1)
    assert parallel_limit(qwen3_5_config().to_dict(), 2, 1) is None


def _check_tp_rank(rank, cases, saved):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine
    from megarl.reshard.resharder import engine_resharder
    from tests.models.test_families_vs_hf import _relayout

    trained = {}
    for name, model_dir, ref_logprobs, ref_entropy, layouts in cases:
        for sp in layouts:
            _relayout(2, 1, 1)
            parallel = ParallelConfig(world_size=dist.get_world_size(), tp=2, sequence_parallel=sp)
            where = f"{name} tp=2 sp={sp}"
            # Qwen3.5 under SP starts from random weights and loads the checkpoint the engine without SP saved
            loads = name == "qwen3_5" and sp
            engine = MegatronEngine(model_dir, ActorConfig(parallel=parallel, micro_batch_size=2), AlgorithmConfig(),
                                    "cpu", 1, 10, load_hf_weights=not loads)
            if loads:
                engine.load_checkpoint(saved, optimizer=False)
            elif name == "qwen3_5":
                engine.save_checkpoint(saved)
            assert engine.gpt.config.sequence_parallel == sp
            # the weight sync's full delivery gathers every tensor into the HF order, bitwise the checkpoint's
            resharder = engine_resharder(engine, dist.get_rank())
            synced = {n: t.clone() for bucket in resharder.buckets(1, "full", 1 << 20, torch.float32)
                      for n, t in bucket}
            checkpoint = load_file(f"{model_dir}/model.safetensors")
            assert sorted(synced) == sorted(checkpoint), where
            for key, tensor in checkpoint.items():
                assert torch.equal(synced[key], tensor), (where, key)
            if name == "qwen3_5":
                assert_like_hf(engine, ref_logprobs, ref_entropy, model_dir, where)
            else:  # fp32 MoE sums in TP's order: up to ~2e-5 from transformers (its own float64 is ~3e-5 away)
                out = engine.compute_logprobs(padded_batch(), with_entropy=True)
                for key, ref in (("logprobs", ref_logprobs), ("entropy", ref_entropy)):
                    torch.testing.assert_close(out[key], ref, rtol=0, atol=6e-5, msg=lambda m: f"{where}: {key}: {m}")
            trained[where] = sft_step(model_dir, parallel)
    return trained


def test_tp2_with_and_without_sp_matches_transformers(tmp_path):
    """TP=2 cuts the gated delta nets by heads (Qwen3.5 dense with and without sequence parallelism; Qwen3-Next, whose
    in_proj is grouped per key head, with its experts at expert-TP 2, under SP): log-probs and entropy as transformers'
    in float32, the export bitwise, and one SFT Adam step's loss, gradient norm and weights as transformers +
    torch.optim.Adam's; the TP=2 checkpoint saved without SP loads under SP; the weight sync's full delivery is the
    checkpoint bitwise (in_proj_qkv / in_proj_qkvz and conv1d gathered from each rank's heads). The linear-attention norm's weight, which every head uses, gets its gradient summed over TP
    (models/gated_delta_net.py); each rank's own share alone moves the gradient norm."""
    from tests.models.hf_families import qwen3_next_config

    cases, refs = [], {}
    for name, config, layouts in (("qwen3_5", qwen3_5_config(), (False, True)),
                                  ("qwen3_next", qwen3_next_config(), (True,))):
        model_dir = save_random(config, tmp_path / name, seed=13)
        cases.append((name, model_dir, *hf_logprobs_entropy(model_dir, padded_batch()), layouts))
        refs[name] = _hf_sft_step(model_dir, tmp_path / f"{name}-step")

    trained = run_distributed(_check_tp_rank, 2, cases, str(tmp_path / "checkpoint"), timeout=240)

    assert sorted(trained) == ["qwen3_5 tp=2 sp=False", "qwen3_5 tp=2 sp=True", "qwen3_next tp=2 sp=True"]
    for name, ref in refs.items():
        _assert_like_hf_step({k: v for k, v in trained.items() if k.startswith(name + " ")}, *ref)


def _check_rank(rank, model_dir, ref_logprobs, ref_entropy):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.engine import MegatronEngine

    trained = {}
    for tp, pp, attention in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp)
        model_parallel_cuda_manual_seed(1)
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp)
        where = f"pp={pp} attention={attention}"
        engine = MegatronEngine(model_dir, ActorConfig(parallel=parallel, micro_batch_size=2, attention=attention),
                                AlgorithmConfig(), "cpu", 1, 10)
        assert_like_hf(engine, ref_logprobs, ref_entropy, model_dir, where)
        if attention != "varlen":  # its sequence starts differ from the mask's only in where they are read
            trained[where] = sft_step(model_dir, parallel, attention=attention)
    return trained


def test_qwen3_5_matches_transformers_at_dp2_and_pp2(tmp_path):
    model_dir = save_random(qwen3_5_config(), tmp_path / "qwen3_5", seed=3)
    ref_logprobs, ref_entropy = hf_logprobs_entropy(model_dir, padded_batch())
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(model_dir, tmp_path / "hf-step")

    trained = run_distributed(_check_rank, 2, model_dir, ref_logprobs, ref_entropy, timeout=240)

    assert sorted(trained) == ["pp=1 attention=local", "pp=2 attention=local"]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)


def test_grpo_steps_with_a_qwen3_5_policy_at_tp2(tmp_path, ray_local):
    """GRPO end to end on the CPU: the transformers rollout engine generates with the tiny Qwen3.5 (its own torch
    gated delta rule, cache and all), megatron trains it at TP=2, and the weights synced into the rollout engine after
    every step are verified by checksums; the engine ends up holding the trained policy bitwise as the export gives it
    (TP=2's export is TP=1's: test_tp2_with_and_without_sp_matches_transformers). in_proj_qkv and conv1d reach it
    gathered from each rank's heads of q, k and v. GRPO at PP=2: test_qwen3_5_mm.py."""
    from megarl.workers import sync_checks
    from tests.models.family_grpo import grpo_then_weights
    from tests.models.hf_families import save_random_for_recipe

    model = save_random_for_recipe(qwen3_5_config(), tmp_path / "qwen3_5", seed=5)
    state, held, steps = grpo_then_weights(model, tmp_path / "run", [
        "actor.parallel.tp=2", "actor.micro_batch_size=4",
        # a random policy earns no reward, so no advantage: the entropy bonus still moves every weight
        "algorithm.entropy_coef=0.01"])

    assert held == {n: sync_checks.tensor_digest(t) for n, t in state.items()}
    initial = load_file(f"{model}/model.safetensors")
    assert sorted(state) == sorted(initial)
    for name in (f"model.layers.0.linear_attn.{n}" for n in ("A_log", "in_proj_qkv.weight", "conv1d.weight")):
        assert not torch.equal(state[name], initial[name])
    assert len(steps) == 2 and all(r["sync/verified"] == 1.0 and r["train/grad_norm"] > 0 for r in steps)
