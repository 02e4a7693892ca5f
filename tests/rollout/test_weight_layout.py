"""megarl's expected checksums of SGLang's parameters (megarl.rollout.weight_layout) against parameters built
independently: the fake server's SGLang view (tests/rollout/fake_sglang.py tp_model: SGLang's narrowing, fusion
and vocabulary padding), and Qwen3-MoE's stacked experts written out here from FusedMoE's layout."""

import pytest
import torch

from megarl.reshard.inventory import hf_inventory
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for, merge
from megarl.utils.checksum import module_checksums
from megarl.workers.weight_sync import WeightSyncError, verify_checksums
from tests.rollout import fake_sglang

QWEN2 = {"model_type": "qwen2", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 1,
         "num_hidden_layers": 2, "intermediate_size": 24, "vocab_size": 100, "tie_word_embeddings": False}
# SGLang's MistralForCausalLM is its Llama: no biases; head_dim 8 given, the attention 32 wide beside hidden 16
MISTRAL = dict(QWEN2, model_type="mistral", head_dim=8)


def _tensors(hf: dict, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g).to(dtype) for s in hf_inventory(hf)}


def _sglang_held(hf: dict, full: dict, tp: int) -> dict:
    held = {}
    for rank in range(tp):
        model = fake_sglang.tp_model(hf, rank, tp)
        model.load_weights(full.items())
        held[rank] = module_checksums(model)
    return {0: held}


@pytest.mark.parametrize("tp", [1, 2, 4])  # TP=2 and 4: K/V heads replicated above their count of 1
@pytest.mark.parametrize("hf", [QWEN2, MISTRAL], ids=["qwen2", "mistral"])
def test_full_tensors_checksum_as_sglang_holds_them(tp, hf):
    full = _tensors(hf)
    layout = layout_for(hf_inventory(hf), "sglang", tp)
    expected = ExpectedChecksums(layout, list(range(tp)))
    for name, t in full.items():
        expected.add(name, t)
    held = _sglang_held(hf, full, tp)
    verify_checksums(expected.result(), held)
    assert ("model.layers.1.self_attn.qkv_proj.bias" in held[0][tp - 1]) is (hf is QWEN2)

    held[0][tp - 1]["model.layers.1.mlp.gate_up_proj.weight"][3] += 1  # a rank holds something else
    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank {tp - 1}: model.layers.1.mlp.gate_up_proj"):
        verify_checksums(expected.result(), held)


def test_shards_sent_by_each_rank_checksum_as_sglang_holds_them():
    """Sharded delivery: each sender posts its rank's rows (as the resharder cuts them); merged, the senders'
    checksums equal SGLang's on every rank. A tensor not sent, or a parameter held but never sent, is named."""
    tp, full = 2, _tensors(QWEN2)
    specs = hf_inventory(QWEN2)
    layout = layout_for(specs, "sglang", tp)
    parts = []
    for rank in range(tp):
        expected = ExpectedChecksums(layout, [rank], presharded=True)
        for spec in specs:
            lo, hi = layout.rows(spec.name, rank)
            piece = full[spec.name] if spec.dim is None else full[spec.name].narrow(spec.dim, lo, hi - lo)
            expected.add(spec.name if spec.dim is None else (spec.name, spec.dim, lo, hi), piece)
        parts.append(expected.result())
    held = _sglang_held(QWEN2, full, tp)
    verify_checksums(merge(parts), held)

    del parts[1][(1, "model.norm.weight")]
    with pytest.raises(WeightSyncError, match=r"1 held but never sent \['server 0 rank 1: model.norm.weight'\]"):
        verify_checksums(merge(parts), held)


QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 4, "num_hidden_layers": 1, "moe_intermediate_size": 6, "num_experts": 3, "vocab_size": 64,
             "tie_word_embeddings": True, "intermediate_size": 12}
# Mixtral: experts intermediate_size wide, block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down), as SGLang's
# MixtralForCausalLM loads them (FusedMoE.make_expert_params_mapping with w1/w2/w3) into block_sparse_moe.experts
MIXTRAL = {"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "intermediate_size": 6, "num_local_experts": 3, "vocab_size": 64,
           "tie_word_embeddings": True}


@pytest.mark.parametrize("hf, moe, parts", [(QWEN3_MOE, "mlp", ("gate_proj", "up_proj", "down_proj")),
                                            (MIXTRAL, "block_sparse_moe", ("w1", "w3", "w2"))], ids=["qwen3_moe", "mixtral"])
def test_stacked_experts_checksum_as_fused_moe_holds_them(hf, moe, parts):
    full, tp = _tensors(hf), 2
    layout = layout_for(hf_inventory(hf), "sglang", tp)
    expected = ExpectedChecksums(layout, [0, 1])
    for name, t in full.items():
        expected.add(name, t)
    got = expected.result()
    layer = f"model.layers.0.{moe}."
    assert {n for n in layout.parameters(0) if n.startswith(layer)} == {
        layer + "gate.weight", layer + "experts.w13_weight", layer + "experts.w2_weight"}
    p, (gate, up, down) = layer + "experts.", parts
    for rank in range(tp):  # FusedMoE: w13[e] = [gate rows; up rows] of the rank's block, w2[e] = down's columns
        cut = slice(rank * 3, rank * 3 + 3)
        w13 = torch.stack([torch.cat([full[f"{p}{e}.{gate}.weight"][cut], full[f"{p}{e}.{up}.weight"][cut]])
                           for e in range(3)])
        w2 = torch.stack([full[f"{p}{e}.{down}.weight"][:, cut] for e in range(3)])
        fused = torch.nn.Module()
        fused.w13_weight, fused.w2_weight = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
        held = module_checksums(fused)
        for name in ("w13_weight", "w2_weight"):
            assert got[(rank, p + name)] == (held[name][0], *held[name][2:4]), (rank, name)


@pytest.mark.parametrize("kv_heads", [1, 2])  # at generation TP=4 K/V rows go to several ranks, whole (1) or in blocks
def test_row_blocks_into_an_engine_of_whole_tensors_are_counted_once(kv_heads):
    """Sharded delivery into the hf engine: every generation rank sends its rows, the replicated tensors and K/V
    heads replicated above their count more than once; the engine holds one whole copy of each tensor."""
    hf = dict(QWEN2, num_key_value_heads=kv_heads)
    tp, full, specs = 4, _tensors(hf, torch.float32), hf_inventory(hf)
    layout = layout_for(specs, "hf")
    parts = []
    for rank in range(tp):
        expected = ExpectedChecksums(layout, [0], sender=(rank, tp))
        for spec in specs:
            lo, hi = spec.rows(tp, rank)
            if spec.dim is None or (lo, hi) == (0, spec.length):
                expected.add(spec.name, full[spec.name])
            else:
                expected.add((spec.name, spec.dim, lo, hi), full[spec.name].narrow(spec.dim, lo, hi - lo))
        parts.append(expected.result())
    engine = torch.nn.Module()
    for i, (name, t) in enumerate(full.items()):
        engine.register_parameter(f"p{i}", torch.nn.Parameter(t))
    names = dict(zip((f"p{i}" for i in range(len(full))), full))
    held = {0: {0: {names[n]: v for n, v in module_checksums(engine).items()}}}
    verify_checksums(merge(parts), held)
