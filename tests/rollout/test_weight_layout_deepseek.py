"""megarl's expected checksums of SGLang's DeepSeek parameters (megarl.rollout.weight_layout) against one TP rank of
SGLang's DeepSeek model as its own source holds and loads weights (tests/rollout/fake_sglang_deepseek.py): fused
a-projections, shared experts, fp32 routing bias, the MLA tensors post_load_weights derives from kv_b_proj, routed
experts placed by --ep-size (whole experts of the rank's EP slice, MoE-TP rows), and the load-per-call semantics
that drop an a-projection split from its partner by a bucket boundary; GLM-4.5 (the same MoE layers beside
grouped-query attention with biases and QK-norm). Checksums inside the "server" are taken by megarl's own
inspect_weights, the function SGLang's TP workers run."""

import json

import pytest
import torch

from megarl.reshard.inventory import hf_inventory
from megarl.rollout.sglang_layout import keep_fused_pairs, sglang_fuses_shared_experts
from megarl.rollout.transports.sglang_loader import inspect_weights, load_presharded
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for, merge
from megarl.workers.weight_sync import WeightSyncError, verify_checksums
from tests.rollout.fake_sglang_deepseek import DeepseekRank

MLA = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5, intermediate_size=24, moe_intermediate_size=8, n_routed_experts=4,
           n_shared_experts=1, vocab_size=100, tie_word_embeddings=False, num_hidden_layers=2, first_k_dense_replace=1)
V3 = dict(MLA, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], q_lora_rank=12, topk_method="noaux_tc")
V2 = dict(MLA, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None, topk_method="greedy")


def _tensors(hf: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in hf_inventory(hf)}


def _buckets(tensors: dict, size: int) -> list[list]:
    items = list(tensors.items())
    return [items[k:k + size] for k in range(0, len(items), size)]


def _server(hf: dict, tp: int, **kwargs) -> list[DeepseekRank]:
    return [DeepseekRank(hf, rank, tp, **kwargs) for rank in range(tp)]


def _ep_args(ep: int) -> list[str]:
    return ["--ep-size", str(ep)] if ep > 1 else []


def _load(ranks: list[DeepseekRank], buckets) -> None:
    for bucket in buckets:  # one load_weights call per bucket, as every transport does
        for model in ranks:
            model.load_weights(bucket)


def _expected(hf: dict, tensors: dict, tp: int, layout_hf: dict | None = "same", ep: int = 1) -> dict:
    layout = layout_for(hf_inventory(hf), "sglang", tp, hf=hf if layout_hf == "same" else layout_hf,
                          sglang_args=_ep_args(ep))
    expected = ExpectedChecksums(layout, list(range(tp)))
    for name, t in tensors.items():
        expected.add(name, t)
    return expected.result()


def _held(ranks: list[DeepseekRank], tmp_path) -> dict:
    """What megarl's loader inside SGLang reports for each rank (inspect_weights writes a file per rank)."""
    held = {}
    for rank, model in enumerate(ranks):
        path = tmp_path / f"rank{rank}.json"
        inspect_weights(model, {"checksums": str(path)})
        held[rank] = json.loads(path.read_text())
    return {0: held}


@pytest.mark.parametrize("hf,tp,ep", [(V3, 1, 1), (V3, 2, 1), (V2, 2, 1), (V3, 2, 2), (V3, 4, 2)],
                         ids=["v3-tp1", "v3-tp2", "v2-tp2", "v3-tp2-ep2", "v3-tp4-ep2"])
def test_deepseek_checksums_as_sglang_holds_them(hf, tp, ep, tmp_path):
    """Two syncs in buckets of 5 tensors: after each, every parameter and derived tensor of every rank matches (the
    second proves the derived w_kc/w_vc follow new kv_b_proj values through an update). With --ep-size (`ep`) each
    rank holds whole experts of its EP slice (TP=2) or their MoE-TP rows (TP=4: 2 x 2)."""
    ranks = _server(hf, tp, ep=ep)
    for seed in (0, 1):
        tensors = _tensors(hf, seed)
        _load(ranks, keep_fused_pairs(_buckets(tensors, 5)))
        expected, held = _expected(hf, tensors, tp, ep=ep), _held(ranks, tmp_path)
        verify_checksums(expected, held)
    w13 = held[0][tp - 1]["model.layers.1.mlp.experts.w13_weight"][1]
    assert w13 == [4 // ep, 2 * 8 // (tp // ep), 16]  # [experts of the rank, 2 x MoE-TP rows, hidden]
    attn = "model.layers.1.self_attn."
    names = held[0][tp - 1]
    assert {attn + "w_kc", attn + "w_vc", attn + "kv_b_proj.weight"} <= set(names)
    assert names[attn + "w_vc"][1] == [4 // tp, 8, 5]  # [heads of the rank, kv_lora, v]
    assert (attn + "fused_qkv_a_proj_with_mqa.weight" in names) == bool(hf["q_lora_rank"])
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in names
    bias = names.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert (bias is not None and bias[0] == "torch.float32") == (hf["topk_method"] == "noaux_tc")  # sent in bf16
    assert len(expected) == sum(len(r) for r in held[0].values())  # everything held was sent


def test_stale_derived_tensors_are_named(tmp_path):
    """A loader that does not rerun SGLang's post-processing leaves w_kc/w_vc of the old kv_b_proj: every one of
    them is named, while the parameters themselves all match."""
    ranks = _server(V3, 2)
    _load(ranks, keep_fused_pairs(_buckets(_tensors(V3, 0), 5)))
    for model in ranks:
        model.rederive = False
    tensors = _tensors(V3, 1)
    _load(ranks, keep_fused_pairs(_buckets(tensors, 5)))
    with pytest.raises(WeightSyncError, match=r": 8 differ .*, 0 missing \[\], 0 held but never sent") as error:
        verify_checksums(_expected(V3, tensors, 2), _held(ranks, tmp_path))
    for rank in range(2):
        for layer in range(2):
            for derived in ("w_kc", "w_vc"):
                assert f"server 0 rank {rank}: model.layers.{layer}.self_attn.{derived}" in str(error.value)


def test_bit_flipped_in_a_derived_tensor_is_named(tmp_path):
    tensors = _tensors(V3, 0)
    ranks = _server(V3, 2)
    _load(ranks, keep_fused_pairs(_buckets(tensors, 5)))
    expected = _expected(V3, tensors, 2)
    inspect_weights(ranks[1], {"flip_bit": "model.layers.1.self_attn.w_vc"})  # the test hook SGLang's workers run
    with pytest.raises(WeightSyncError, match=r"1 differ \['server 0 rank 1: model.layers.1.self_attn.w_vc'\]"):
        verify_checksums(expected, _held(ranks, tmp_path))


def test_a_projections_split_by_a_bucket_boundary_are_kept_together(tmp_path):
    """SGLang drops q_a_proj and kv_a_proj_with_mqa arriving in different loads: the fused parameter keeps the
    previous sync's values, which verification names. keep_fused_pairs sends q_a_proj with its partner."""
    names = list(_tensors(V3, 0))
    cut = names.index("model.layers.0.self_attn.q_a_proj.weight") + 1  # a boundary right after q_a_proj
    assert names[cut] != "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"

    def sync(ranks, seed, keep):
        tensors = _tensors(V3, seed)
        items = list(tensors.items())
        buckets = [items[:cut], items[cut:]]
        _load(ranks, keep_fused_pairs(buckets) if keep else buckets)
        return tensors

    ranks = _server(V3, 1)
    sync(ranks, 0, keep=True)
    tensors = sync(ranks, 1, keep=False)
    fused = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank 0: {fused}'\]"):
        verify_checksums(_expected(V3, tensors, 1), _held(ranks, tmp_path))
    tensors = sync(ranks, 2, keep=True)
    verify_checksums(_expected(V3, tensors, 1), _held(ranks, tmp_path))


def test_keep_fused_pairs_moves_q_a_proj_to_its_partner_and_refuses_the_reverse_order():
    q0, kv0 = "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    t = torch.zeros(1)
    out = list(keep_fused_pairs([[("a", t), (q0, t)], [(q0.replace("0", "1"), t), ("b", t)], [(kv0, t)],
                                 [(kv0.replace("0", "1"), t)]]))
    assert [[n for n, _ in b] for b in out] == [["a"], ["b"], [q0, kv0],
                                                [q0.replace("0", "1"), kv0.replace("0", "1")]]
    assert [[n for n, _ in b] for b in keep_fused_pairs([[(kv0, t)], [("x", t)]])] == [[kv0], ["x"]]  # V2: no q_a
    with pytest.raises(ValueError, match=rf"{q0} comes after {kv0} was sent"):
        list(keep_fused_pairs([[(kv0, t)], [(q0, t)]]))
    with pytest.raises(ValueError, match=rf"{q0} without {kv0}"):
        list(keep_fused_pairs([[(q0, t)], [("x", t)]]))


@pytest.mark.parametrize("hf,ep", [(V3, 1), (V2, 1), (V3, 2)], ids=["v3", "v2", "v3-ep2"])
def test_presharded_deepseek_rows_checksum_as_sglang_holds_them(hf, ep, tmp_path):
    """Sharded delivery: each rank's rows loaded with SGLang's presharded switches (sglang_loader.load_presharded); the
    senders' merged checksums, derived tensors from each rank's kv_b_proj rows included, equal what SGLang holds.
    At --ep-size 2 a rank is sent the routed experts of its EP slice only, whole (the resharder's GenLayout rows,
    which the layout uses), and holds what SGLang's own loader keeps of the full tensors."""
    hf = dict(hf, vocab_size=128)  # presharded vocabulary rows: vocab // tp on each rank (check_presharded_vocab)
    tp, tensors, specs = 2, _tensors(hf, 0), hf_inventory(hf)
    layout = layout_for(specs, "sglang", tp, hf=hf, sglang_args=_ep_args(ep))
    ranks, parts = _server(hf, tp, ep=ep), []
    for rank, model in enumerate(ranks):
        expected = ExpectedChecksums(layout, [rank], presharded=True)
        shard = {}
        for spec in specs:
            rows = layout.rows(spec.name, rank)
            if rows is None:  # another EP rank's expert
                continue
            lo, hi = rows
            piece = tensors[spec.name] if spec.dim is None else tensors[spec.name].narrow(spec.dim, lo, hi - lo)
            shard[spec.name] = piece
            whole = spec.dim is None or rows == (0, spec.length)
            expected.add(spec.name if whole else (spec.name, spec.dim, lo, hi), piece)
        sent_experts = {int(n.split(".")[5]) for n in shard if ".mlp.experts." in n}
        assert sent_experts == (set(range(4)) if ep == 1 else {2 * rank, 2 * rank + 1})
        for bucket in keep_fused_pairs(_buckets(shard, 7)):
            load_presharded(model, bucket)
        parts.append(expected.result())
    held = _held(ranks, tmp_path)
    verify_checksums(merge(parts), held)
    reference = _server(hf, tp, ep=ep)  # SGLang's own loading of the full tensors: the same parameters, bitwise
    _load(reference, keep_fused_pairs(_buckets(tensors, 7)))
    assert _held(reference, tmp_path) == held


def test_expert_parallel_layout_names_a_flipped_expert_bit_and_a_wrong_ep_size(tmp_path):
    """At --ep-size 2 a bit flipped in rank 1's w13 after loading is named; a layout told no --ep-size (experts
    TP-cut on every rank) names every rank's w13 and w2 of the MoE layer, as the checksum refusal used to fear."""
    tensors = _tensors(V3, 0)
    ranks = _server(V3, 2, ep=2)
    _load(ranks, keep_fused_pairs(_buckets(tensors, 5)))
    expected = _expected(V3, tensors, 2, ep=2)
    verify_checksums(expected, _held(ranks, tmp_path))
    w13 = "model.layers.1.mlp.experts.w13_weight"
    with pytest.raises(WeightSyncError, match=r"4 differ \['server 0 rank 0: model.layers.1.mlp.experts.w13_weight', "
                                              r"'server 0 rank 0: model.layers.1.mlp.experts.w2_weight', 'server 0 rank 1"):
        verify_checksums(_expected(V3, tensors, 2), _held(ranks, tmp_path))
    inspect_weights(ranks[1], {"flip_bit": w13})
    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank 1: {w13}'\]"):
        verify_checksums(expected, _held(ranks, tmp_path))


def test_shared_expert_fused_into_the_routed_ones(tmp_path):
    """DeepSeek-V3's 256 routed experts and one shared expert: SGLang makes the shared expert number 256 of w13/w2.
    The layout follows the config; a layout not told the config expects shared_experts.* and is named wrong."""
    hf = dict(V3, hidden_size=8, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=256,
              moe_intermediate_size=2, num_hidden_layers=1, first_k_dense_replace=0)
    tensors = _tensors(hf, 0)
    ranks = _server(hf, 1, fuse_shared_experts=True)
    _load(ranks, keep_fused_pairs(_buckets(tensors, 64)))
    held = _held(ranks, tmp_path)
    assert list(held[0][0]["model.layers.0.mlp.experts.w13_weight"][1]) == [257, 4, 8]
    # not under expert parallelism (NVIDIA) nor with --disable-shared-experts-fusion
    assert sglang_fuses_shared_experts(hf) and not sglang_fuses_shared_experts(hf, ep=2)
    assert not sglang_fuses_shared_experts(hf, sglang_args=["--disable-shared-experts-fusion"])
    verify_checksums(_expected(hf, tensors, 1), held)
    with pytest.raises(WeightSyncError, match=r"2 differ \['server 0 rank 0: model.layers.0.mlp.experts.w13_weight', "
                                              r"'server 0 rank 0: model.layers.0.mlp.experts.w2_weight'\], "
                                              r"2 missing \['server 0 rank 0: model.layers.0.mlp.shared_experts"):
        verify_checksums(_expected(hf, tensors, 1, layout_hf=None), held)


# GLM-4.5 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases and QK-norm, head_dim 6 beside hidden 16,
# 2 K/V heads (replicated at TP=4); layer 0 dense, layer 1 DeepSeek-V3's MoE with the routing bias and a shared expert
GLM = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], hidden_size=16, num_attention_heads=4,
           num_key_value_heads=2, head_dim=6, attention_bias=True, use_qk_norm=True, intermediate_size=24,
           moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, vocab_size=100,
           tie_word_embeddings=False, num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=1)


@pytest.mark.parametrize("tp,ep,qkv_rows,w13", [(2, 1, 24, [5, 8, 16]), (4, 1, 18, [5, 4, 16]), (4, 2, 18, [2, 8, 16])],
                         ids=["tp2", "tp4", "tp4-ep2"])
def test_glm4_moe_checksums_as_sglang_holds_them(tp, ep, qkv_rows, w13, tmp_path):
    """GLM-4.5 as SGLang's Glm4MoeForCausalLM holds it, every parameter of every rank by name, shape and checksum:
    q/k/v and their biases in qkv_proj (the rank's 2 or 1 query heads and its K/V head), q_norm/k_norm, the dense
    layer's gate_up_proj, the float32 routing bias, the routed experts in w13/w2 and the one shared expert fused into
    them as expert 4 at --ep-size 1 (SGLang's default for GLM on NVIDIA GPUs), kept apart under --ep-size 2."""
    ranks = _server(GLM, tp, fuse_shared_experts=ep == 1, ep=ep)
    tensors = _tensors(GLM, 0)
    _load(ranks, _buckets(tensors, 5))
    held = _held(ranks, tmp_path)
    verify_checksums(_expected(GLM, tensors, tp, ep=ep), held)
    p = "model.layers.1."
    for rank in range(tp):
        assert list(held[0][rank][p + "self_attn.qkv_proj.weight"][1]) == [qkv_rows, 16]
        assert list(held[0][rank][p + "self_attn.qkv_proj.bias"][1]) == [qkv_rows]
        assert list(held[0][rank][p + "mlp.experts.w13_weight"][1]) == w13
        assert (p + "mlp.shared_experts.gate_up_proj.weight" in held[0][rank]) is (ep > 1)
    assert sglang_fuses_shared_experts(GLM) and not sglang_fuses_shared_experts(GLM, ep=2)
    assert not sglang_fuses_shared_experts(GLM, sglang_args=["--disable-shared-experts-fusion"])
    if ep == 1:  # a layout not told the config expects the shared expert apart
        with pytest.raises(WeightSyncError, match=r"missing \['server 0 rank 0: model.layers.1.mlp.shared_experts"):
            verify_checksums(_expected(GLM, tensors, tp, layout_hf=None), held)
