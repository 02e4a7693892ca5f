"""One ExpectedChecksums across syncs (as TrainWorker and the benchmark keep it): the pieces each tensor sends to
SGLang's parameters are planned at its first sync and reused; a later sync of new values, in new memory at other
storage offsets, must checksum exactly as a fresh plan does and still name a flipped bit. SGLang's side is the
DeepSeek rank of tests/rollout/fake_sglang_deepseek.py at TP=2: TP row shards, fused a-projections, shared
experts, the fp32 routing bias (a conversion) and the derived w_kc/w_vc (transposed views)."""

import pytest
import torch

from megarl.reshard.inventory import hf_inventory
from megarl.rollout.sglang_layout import keep_fused_pairs
from megarl.rollout.transports.sglang_loader import inspect_weights
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
from megarl.workers.sync_checks import WeightSyncError
from megarl.workers.weight_sync import PolicySync, RolloutSide, verify_checksums
from tests.rollout.test_weight_layout_deepseek import V3, _buckets, _held, _load, _server, _tensors


def _in_one_buffer(tensors: dict, shift: int) -> dict:
    """The tensors copied into one flat buffer, `shift` elements in: views at storage offsets of their own, as a
    bucket of the resharder's is."""
    flat = torch.zeros(shift + sum(t.numel() for t in tensors.values()), dtype=torch.bfloat16)
    out, at = {}, shift
    for name, t in tensors.items():
        out[name] = flat[at:at + t.numel()].view(t.shape)
        out[name].copy_(t)
        at += t.numel()
    return out


def _fresh(layout, tensors: dict) -> dict:
    expected = ExpectedChecksums(layout, [0, 1])
    for name, t in tensors.items():
        expected.add(name, t)
    return expected.result()


def test_a_second_sync_reuses_the_plans_and_still_names_a_flipped_bit(tmp_path, monkeypatch):
    layout = layout_for(hf_inventory(V3), "sglang", 2, hf=V3)
    expected, ranks = ExpectedChecksums(layout, [0, 1]), _server(V3, 2)
    first = _tensors(V3, 0)
    expected.begin()
    for name, t in first.items():
        expected.add(name, t)
    assert expected.result() == _fresh(layout, first)
    assert len(expected.plans) == len(first) and all(steps is not None for _, steps in expected.plans.values())

    for lookup in ("piece", "place", "as_held", "derived"):  # the second sync must not ask the layout anything
        monkeypatch.setattr(layout, lookup, lambda *a, lookup=lookup: pytest.fail(f"layout.{lookup} at sync 2"))
    second = _in_one_buffer(_tensors(V3, 1), shift=3)
    _load(ranks, keep_fused_pairs(_buckets(second, 5)))
    expected.begin()  # without it the first sync's sums would still be in the table
    for name, t in second.items():
        expected.add(name, t)
    got = expected.result()
    monkeypatch.undo()
    assert got == _fresh(layout, second) != _fresh(layout, first)
    verify_checksums(got, _held(ranks, tmp_path))
    for rank, name in ((1, "model.layers.1.self_attn.w_vc"), (0, "model.layers.1.mlp.gate.e_score_correction_bias"),
                       (1, "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight")):
        inspect_weights(ranks[rank], {"flip_bit": name})
        with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank {rank}: {name}"):
            verify_checksums(got, _held(ranks, tmp_path))
        inspect_weights(ranks[rank], {"flip_bit": name})  # and back


def test_a_tensor_of_another_shape_or_layout_gets_a_new_plan():
    layout = layout_for(hf_inventory(V3), "sglang", 2, hf=V3)
    expected, tensors = ExpectedChecksums(layout, [0, 1]), _tensors(V3, 0)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    expected.add(name, tensors[name])
    planned = expected.plans[name]
    transposed = tensors[name].t().contiguous().t()  # the same values with other strides
    expected.begin()
    expected.add(name, transposed)
    assert expected.plans[name] is not planned and expected.plans[name][0][1] == transposed.stride()
    fresh = ExpectedChecksums(layout, [0, 1])
    fresh.add(name, tensors[name])
    assert expected.result() == fresh.result()


def test_push_policy_starts_each_sync_of_a_kept_expected_checksums_afresh():
    """Two syncs through PolicySync.push with one ExpectedChecksums (the rollout actor loads: no server): each
    sync's result is that sync's tensors' alone."""
    layout = layout_for(hf_inventory(V3), "sglang", 2, hf=V3)
    expected = ExpectedChecksums(layout, [0, 1])
    for seed in (0, 1):
        tensors = _tensors(V3, seed)
        report = PolicySync().push(iter(keep_fused_pairs(_buckets(tensors, 5))), RolloutSide(
            begin=lambda: None, end=None, load=lambda bucket: (lambda: None)), verify=True, expected=expected)
        assert report.expected == _fresh(layout, tensors)
