"""Packed micro-batches (no padding, block-diagonal causal mask or cu_seqlens, reset positions), SDPA and
varlen core attention, sequence parallelism, virtual pipeline stages and activation recompute: the same
per-token log-probs as transformers and the same loss and gradients as the padded batch at PP=1.
attention=varlen runs its CPU kernel here (one SDPA per segment: the cu_seqlens path the GPU's flash
kernel takes; tests/engine/test_megatron_gpu.py compares the flash kernel with masked SDPA)."""

import pytest
import torch

from megarl.algorithms.advantages import masked_whiten
from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from megarl.engine.attention import segment_sdpa
from megarl.engine.packing import (balanced_partition, block_causal_mask, pack_micro_batches, segment_bounds,
                                   sequence_lengths, unpack)
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, make_qwen2_dir, padded_batch

# seq-mean-token-mean: a loss that needs each sequence's own tokens, whatever row it is packed in
ALGO = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
BUDGET = 24  # tokens per micro-batch: 2 rows of the longest sequence (11; 12 under SP at TP=2)
# name: (tp, pp, vpp, max_tokens_per_micro_batch, attention, recompute, sequence_parallel, packing) on 2 ranks
# "padded": the default packing (one_row) without a token budget keeps padded rows under a dense mask (local)
LAYOUTS = {"padded": (1, 1, 1, 0, "local", "none", False, "one_row"),
           "packed": (1, 1, 1, BUDGET, "local", "none", False, "rows"),
           "packed_sdpa": (1, 1, 1, BUDGET, "sdpa", "none", False, "rows"),
           "packed_varlen": (1, 1, 1, BUDGET, "varlen", "none", False, "rows"),
           "tp2_sp_packed_varlen": (2, 1, 1, BUDGET, "varlen", "none", True, "rows"),
           "tp2_sp_padded": (2, 1, 1, 0, "local", "none", True, "rows"),
           "vpp_packed_sdpa_recompute": (1, 2, 2, BUDGET, "sdpa", "full", False, "rows"),
           "vpp_padded_selective": (1, 2, 2, 0, "local", "selective", False, "rows"),
           # one row per micro-batch: trimmed rows of different widths at PP=1 (ONE_ROW_TRIM = 8 below), TP=2
           # with SP, and fixed-width rows between pipeline stages (the automatic width, 2 x 11)
           "one_row_varlen": (1, 1, 1, BUDGET, "varlen", "none", False, "one_row"),
           "tp2_sp_one_row_varlen": (2, 1, 1, BUDGET, "varlen", "none", True, "one_row"),
           "pp2_one_row_varlen_auto": (1, 2, 1, 0, "varlen", "none", False, "one_row"),
           # the GPU's defaults (no token budget, one_row, varlen): one row of micro_batch_size x the longest sequence
           "one_row_varlen_auto": (1, 1, 1, 0, "varlen", "none", False, "one_row")}
ONE_ROW_TRIM = 8  # the engine's ONE_ROW_TRIM_MULTIPLE in the test (64 is wider than these rows)


def rl_batch():
    batch = padded_batch(rows=8, T=11)  # odd width: sequence parallelism at TP=2 pads rows to 12
    g = torch.Generator().manual_seed(3)
    batch["advantages"] = masked_whiten(torch.randn(batch["tokens"].shape, generator=g), batch["loss_mask"])
    batch["ref_logprobs"] = -torch.rand(batch["tokens"].shape, generator=g) * batch["loss_mask"]
    return batch


# ---- the packing itself (no processes) ------------------------------------------------------------

def test_packing_keeps_every_sequence_whole_and_alone():
    batch = padded_batch(rows=8)
    lengths = sequence_lengths(batch["attention_mask"])
    assert lengths == [12, 7, 1, 10, 4, 9, 12, 3]
    mbs = pack_micro_batches(batch, ["loss_mask"], "cpu", micro_batch_size=2, max_tokens=BUDGET)
    assert all(mb["tokens"].shape == (2, 12) for mb in mbs)
    assert len(mbs) == 3 < 4  # 58 tokens in 5 rows of 12 instead of 8 padded rows
    assert any(mb["packed"] for mb in mbs)
    seen = torch.cat([mb["seq_index"] for mb in mbs])
    assert sorted(seen.tolist()) == list(range(8))
    for mb in mbs:
        original = batch.index(mb["seq_index"])
        # unpack restores each sequence's tokens and loss mask in its own [S, T] row
        assert torch.equal(unpack(mb["tokens"], mb), original["tokens"])
        assert torch.equal(mb["loss_mask"], original["loss_mask"])
        mask = block_causal_mask(mb["doc_ids"])[:, 0]
        for r in range(2):
            docs = mb["doc_ids"][r]
            for d in docs.unique().tolist():
                if d == 0:
                    continue
                where = (docs == d).nonzero().squeeze(1)
                assert torch.equal(mb["position_ids"][r, where], torch.arange(len(where)))
                # a query of this sequence sees exactly the earlier tokens of this sequence
                q = where[-1]
                assert torch.equal((~mask[r, q]).nonzero().squeeze(1), where)


def test_pairs_stay_in_one_micro_batch_and_dp_split_is_balanced():
    batch = padded_batch(rows=8)
    lengths = sequence_lengths(batch["attention_mask"])
    for mb in pack_micro_batches(batch, [], "cpu", micro_batch_size=2, max_tokens=BUDGET, group_size=2):
        ids = set(mb["seq_index"].tolist())
        assert all(i ^ 1 in ids for i in ids), ids  # rows 2k and 2k+1 together
    parts = balanced_partition(lengths, 2)
    assert sorted(parts[0] + parts[1]) == list(range(8)) and len(parts[0]) == len(parts[1]) == 4
    totals = [sum(lengths[i] for i in p) for p in parts]
    assert abs(totals[0] - totals[1]) <= 2, totals  # consecutive halves would be 30 vs 28
    pairs = balanced_partition(lengths, 2, group_size=2)
    assert all(i ^ 1 in part for part in pairs for i in part)
    with pytest.raises(ValueError, match="equal parts"):
        balanced_partition(lengths[:6], 4)


def test_segments_and_width_multiple():
    batch = padded_batch(rows=8, T=11)
    mbs = pack_micro_batches(batch, ["loss_mask"], "cpu", micro_batch_size=2, max_tokens=BUDGET, width_multiple=4)
    for mb in mbs:
        assert mb["tokens"].shape[1] == 12 and mb["loss_mask"].shape == (len(mb["seq_index"]), 12)
        assert torch.equal(unpack(mb["tokens"], mb)[:, :11], batch.index(mb["seq_index"])["tokens"])
        # causal attention within each segment of cu_seqlens is the block-diagonal causal mask
        bounds = mb["cu_seqlens"]
        assert bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == mb["tokens"].numel()
        L = mb["tokens"].shape[1]
        segment = torch.searchsorted(bounds, torch.arange(mb["tokens"].numel(), dtype=torch.int32), right=True)
        allowed = (segment[:, None] == segment[None, :]) & torch.ones(L * 2, L * 2, dtype=torch.bool).tril()
        for r in range(2):
            rows = slice(r * L, (r + 1) * L)
            assert torch.equal(allowed[rows, rows], ~block_causal_mask(mb["doc_ids"])[r, 0])
            assert not allowed[rows, :r * L].any()
    assert segment_bounds(torch.tensor([[1, 1, 2, 0], [1, 0, 0, 0]])).tolist() == [0, 2, 3, 4, 5, 8]
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    out = segment_sdpa(q, k, v, torch.tensor([0, 3, 8], dtype=torch.int32), 5, 0.3)
    alone = torch.nn.functional.scaled_dot_product_attention(q[3:].transpose(0, 1), k[3:].transpose(0, 1),
                                                             v[3:].transpose(0, 1), is_causal=True, scale=0.3,
                                                             enable_gqa=True)
    torch.testing.assert_close(out[3:], alone.transpose(0, 1))


def test_one_row_layout_packs_any_number_of_sequences_into_one_row():
    batch = padded_batch(rows=8, T=11)
    lengths = sequence_lengths(batch["attention_mask"])
    assert lengths == [11, 7, 1, 10, 4, 9, 11, 3]
    mbs = pack_micro_batches(batch, ["loss_mask"], "cpu", 2, max_tokens=BUDGET, layout="one_row", trim_multiple=8)
    # first-fit-decreasing into rows of 24: [11, 11, 1], [10, 9, 4], [7, 3] -> the last cut to 16
    assert [mb["tokens"].shape for mb in mbs] == [(1, 24), (1, 24), (1, 16)]
    assert [mb["seq_index"].tolist() for mb in mbs] == [[0, 6, 2], [3, 5, 4], [1, 7]]
    assert all(mb["packed"] for mb in mbs)
    for mb in mbs:
        original = batch.index(mb["seq_index"])
        assert torch.equal(unpack(mb["tokens"], mb), original["tokens"])
        assert torch.equal(mb["loss_mask"], original["loss_mask"])
        assert mb["cu_seqlens"][-1] == mb["tokens"].shape[1]
    # without trimming every row is W wide (pipeline stages); W rounds up to the width multiple (SP)
    fixed = pack_micro_batches(batch, [], "cpu", 2, max_tokens=23, layout="one_row", width_multiple=4)
    assert {mb["tokens"].shape for mb in fixed} == {(1, 24)}
    for mb in pack_micro_batches(batch, [], "cpu", 2, max_tokens=BUDGET, group_size=2, layout="one_row"):
        ids = set(mb["seq_index"].tolist())
        assert all(i ^ 1 in ids for i in ids), ids  # preference pairs stay together
    with pytest.raises(ValueError, match=r"sequence 0 has 11 tokens, more than .* of 10 \(actor.max_tokens_per_micro_batch=10"):
        pack_micro_batches(batch, [], "cpu", 2, max_tokens=10, layout="one_row")
    # no token budget (the defaults): rows of micro_batch_size x the longest sequence, 2 x 11 = 22 token slots as
    # the 4 padded micro-batches of 2 rows x 11: [11, 11], [10, 9, 3], [7, 4, 1]
    assert [mb["tokens"].shape for mb in pack_micro_batches(batch, [], "cpu", 2, layout="rows")] == [(2, 11)] * 4
    auto = pack_micro_batches(batch, [], "cpu", 2, layout="one_row")
    assert [mb["seq_index"].tolist() for mb in auto] == [[0, 6], [3, 5, 7], [1, 4, 2]]
    assert {mb["tokens"].shape for mb in auto} == {(1, 22)}
    # width multiple 4 (SP at TP=4): 2 x 12; trimmed: the used length rounded up
    assert {mb["tokens"].shape for mb in pack_micro_batches(batch, [], "cpu", 2, layout="one_row",
                                                             width_multiple=4)} == {(1, 24)}
    assert [mb["tokens"].shape[1] for mb in pack_micro_batches(batch, [], "cpu", 2, layout="one_row",
                                                                trim_multiple=8)] == [22, 22, 16]


# ---- through the engine (2 gloo ranks, one launch) ------------------------------------------------

def _relayout(tp, pp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1)


def _layouts_rank(rank, model_dir, old_logprobs, layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.engine import MegatronEngine
    from megarl.engine.weights import global_parameters

    from megarl.engine import megatron_engine

    megatron_engine.ONE_ROW_TRIM_MULTIPLE = ONE_ROW_TRIM
    results = {}
    for name, (tp, pp, vpp, max_tokens, attention, recompute, sp, packing) in layouts.items():
        _relayout(tp, pp)
        actor = ActorConfig(parallel=ParallelConfig(world_size=2, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp),
                            micro_batch_size=2, max_tokens_per_micro_batch=max_tokens, packing=packing,
                            attention=attention, recompute=recompute, optim=OptimConfig(lr=1e-2, clip_grad=0.0))
        engine = MegatronEngine(model_dir, actor, ALGO, "cpu", 1, 10)
        assert len(engine.gpts) == vpp
        batch = rl_batch()
        projected = []  # positions the LM head projects: the real tokens only (output_positions.py)
        hook = engine.gpts[-1].output_layer.register_forward_hook(
            lambda layer, args, output: projected.append(args[0].shape[0] * args[0].shape[1])) \
            if engine.gpts[-1].post_process else None
        run_schedule, counts = engine._run_schedule, []  # micro-batches per call: compute_logprobs, then train
        engine._run_schedule = lambda mbs, *args, **kwargs: counts.append(len(mbs)) or run_schedule(mbs, *args, **kwargs)
        out = engine.compute_logprobs(batch, with_entropy=True)
        if hook:
            hook.remove()
        batch["old_logprobs"] = old_logprobs
        dp = ps.get_data_parallel_world_size()
        rows = balanced_partition(sequence_lengths(batch["attention_mask"]), dp)[ps.get_data_parallel_rank()]
        metrics = engine.train(batch.index(rows))
        grads = {n: p.main_grad.detach().clone() for n, p in global_parameters(engine.gpts).items()}
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, grads)
        results[name] = (out, metrics, {n: g for rank_grads in every_rank for n, g in rank_grads.items()},
                         sum(projected) if projected else None, counts)
    return results


def test_packed_vpp_recompute_and_sdpa_match_the_padded_batch(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True, layers=4)
    ref_logprobs, ref_entropy = hf_logprobs_entropy(model_dir, rl_batch())
    results = run_distributed(_layouts_rank, 2, model_dir, ref_logprobs, LAYOUTS)

    _, base_metrics, base_grads, _, base_counts = results["padded"]
    assert base_counts == [4, 2]  # 8 rows (4 per DP rank in training) in padded micro-batches of 2 (dense mask)
    # the defaults pack 22 token slots per micro-batch: [11, 11], [10, 9, 3], [7, 4, 1]; in training at DP=2 this
    # rank's 4 sequences (28 tokens) still take 2, at PP=2 (DP=1) the 8 take 3 (4 padded)
    assert results["one_row_varlen_auto"][4] == [3, 2] and results["pp2_one_row_varlen_auto"][4] == [3, 3]
    assert base_metrics["grad_norm"] > 0 and len(base_grads) == 4 * 7 + 2
    base_out = results["padded"][0]
    # 4 layers of large random weights: fp32 differences from transformers' kernels reach 1e-5
    torch.testing.assert_close(base_out["logprobs"], ref_logprobs, rtol=0, atol=5e-5)
    torch.testing.assert_close(base_out["entropy"], ref_entropy, rtol=0, atol=5e-5)
    real_tokens = sum(sequence_lengths(rl_batch()["attention_mask"]))
    for name, (out, metrics, grads, projected, _) in results.items():
        # rank 0 holds the LM head unless it is a first pipeline stage
        assert projected == (None if LAYOUTS[name][1] > 1 else real_tokens), (name, projected)
        torch.testing.assert_close(out["logprobs"], base_out["logprobs"], rtol=0, atol=3e-5, msg=name)
        torch.testing.assert_close(out["entropy"], base_out["entropy"], rtol=0, atol=3e-5, msg=name)
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert abs(metrics[key] - base_metrics[key]) < 1e-5 * max(1.0, abs(base_metrics[key])), (name, key)
        # At TP=2 only the replicated parameters (the norms: under SP, partial per rank until summed over TP)
        # have the padded layout's shape; the grad norm above covers the shards.
        compared = [param for param, grad in base_grads.items() if grads[param].shape == grad.shape]
        assert len(compared) == (len(base_grads) if LAYOUTS[name][0] == 1 else 4 * 2 + 1), name
        for param in compared:
            # float32 summation order differs between layouts (and SDPA fuses differently): 1e-5 of the largest entry
            grad = base_grads[param]
            diff, scale = (grads[param] - grad).abs().max().item(), grad.abs().max().item()
            assert diff <= 1e-5 * scale, (name, param, diff, scale)
