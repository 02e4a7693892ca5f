"""megarl's expected checksums of SGLang's Qwen3.5, Qwen3.5-MoE and Qwen3-Next parameters (megarl.rollout.sglang_layout)
against each TP rank's tensors built here from the HF tensors by SGLang's own rules (models/qwen3_5.py,
models/qwen3_next.py): the attention without its self_attn. prefix in qkv_proj (q_proj's per-head query and gate
rows as QKVParallelLinear's q part), Qwen3.5's in_proj_qkv + in_proj_z in in_proj_qkvz and in_proj_b + in_proj_a in
in_proj_ba with each part cut by TP, Qwen3-Next's grouped in_proj_qkvz / in_proj_ba cut in contiguous blocks, conv1d
cut part by part, A_log held in float32, the shared expert's gate_up_proj and the routed experts' w13/w2 (whole
experts of the rank's EP slice under --ep-size); and the settings the layout cannot serve, refused by name."""

import pytest
import torch

from megarl.reshard.inventory import hf_inventory
from megarl.rollout.sglang_layout import check_hybrid_rollout, sglang_vocab_rows
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
from megarl.utils.checksum import module_checksums
from megarl.workers.weight_sync import WeightSyncError, verify_checksums
from tests.models.hf_families import qwen3_5_config, qwen3_next_config

QWEN3_5 = qwen3_5_config().to_dict()
QWEN3_5_MOE = qwen3_next_config(moe_text=True).to_dict()
QWEN3_NEXT = qwen3_next_config().to_dict()
NO_FUSION = ["--disable-shared-experts-fusion"]


class _Held:
    """A rank's parameters as a named_parameters() owner (what module_checksums reads)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def named_parameters(self):
        return iter(self.tensors.items())


def _block(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim)[rank]


def _sglang_rank(hf: dict, full: dict, tp: int, rank: int, ep: int = 1) -> dict:
    """What SGLang TP rank `rank` of `tp` holds of HF tensors `full`, written out from its loaders' rules."""
    held = {}
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    qk, v = hf["linear_num_key_heads"] * hf["linear_key_head_dim"], hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # VocabParallelEmbedding: padded to 64, zeros
        lo, hi = sglang_vocab_rows(vocab, tp, rank)
        per = -(-vocab // 64) * 64 // tp
        held[name] = torch.cat([full[name][lo:hi], torch.zeros(per - (hi - lo), h, dtype=full[name].dtype)])
    held["model.norm.weight"] = full["model.norm.weight"]
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            held[p + norm + ".weight"] = full[p + norm + ".weight"]
        if kind == "full_attention":
            a = p + "self_attn."
            held[p + "qkv_proj.weight"] = torch.cat([_block(full[a + f"{x}_proj.weight"], tp, rank) for x in "qkv"])
            held[p + "o_proj.weight"] = _block(full[a + "o_proj.weight"], tp, rank, 1)
            held[p + "q_norm.weight"], held[p + "k_norm.weight"] = full[a + "q_norm.weight"], full[a + "k_norm.weight"]
        else:
            a = p + "linear_attn."
            if hf["model_type"] == "qwen3_next":  # grouped per key head: ColumnParallelLinear's contiguous blocks
                held[a + "in_proj_qkvz.weight"] = _block(full[a + "in_proj_qkvz.weight"], tp, rank)
                held[a + "in_proj_ba.weight"] = _block(full[a + "in_proj_ba.weight"], tp, rank)
            else:  # MergedColumnParallelLinear of [q, k, v, z] and [b, a]: each part's TP block
                q, k, v_ = full[a + "in_proj_qkv.weight"].split([qk, qk, v])
                held[a + "in_proj_qkvz.weight"] = torch.cat(
                    [_block(t, tp, rank) for t in (q, k, v_, full[a + "in_proj_z.weight"])])
                held[a + "in_proj_ba.weight"] = torch.cat(
                    [_block(full[a + f"in_proj_{x}.weight"], tp, rank) for x in "ba"])
            held[a + "conv1d.weight"] = torch.cat(  # mamba_v2_sharded_weight_loader: q, k, v each by TP
                [_block(t, tp, rank) for t in full[a + "conv1d.weight"].split([qk, qk, v])])
            held[a + "dt_bias"] = _block(full[a + "dt_bias"], tp, rank)
            held[a + "A_log"] = _block(full[a + "A_log"], tp, rank).float()  # created float32
            held[a + "norm.weight"] = full[a + "norm.weight"]
            held[a + "out_proj.weight"] = _block(full[a + "out_proj.weight"], tp, rank, 1)
        m = p + "mlp."
        if "num_experts" not in hf:
            held[m + "gate_up_proj.weight"] = torch.cat([_block(full[m + f"{x}_proj.weight"], tp, rank)
                                                         for x in ("gate", "up")])
            held[m + "down_proj.weight"] = _block(full[m + "down_proj.weight"], tp, rank, 1)
            continue
        s = m + "shared_expert."
        held[s + "gate_up_proj.weight"] = torch.cat([_block(full[s + f"{x}_proj.weight"], tp, rank) for x in ("gate", "up")])
        held[s + "down_proj.weight"] = _block(full[s + "down_proj.weight"], tp, rank, 1)
        held[m + "shared_expert_gate.weight"], held[m + "gate.weight"] = full[m + "shared_expert_gate.weight"], full[m + "gate.weight"]
        experts, moe_tp = hf["num_experts"], tp // ep  # FusedMoE: the EP rank's contiguous experts, MoE-TP rows
        mine = range(rank // moe_tp * experts // ep, (rank // moe_tp + 1) * experts // ep)
        t = rank % moe_tp
        held[m + "experts.w13_weight"] = torch.stack([torch.cat(
            [_block(full[m + f"experts.{e}.{x}_proj.weight"], moe_tp, t) for x in ("gate", "up")]) for e in mine])
        held[m + "experts.w2_weight"] = torch.stack(
            [_block(full[m + f"experts.{e}.down_proj.weight"], moe_tp, t, 1) for e in mine])
    return held


def _tensors(hf: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in hf_inventory(hf)}


@pytest.mark.parametrize("hf", [QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT], ids=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "tp2-ep2"])
def test_hybrid_checksums_as_sglang_holds_them(hf, tp, ep):
    """Whole HF tensors (full delivery) into SGLang at TP 1 and 2 (and EP 2 for the MoE models): every parameter
    of every rank, as SGLang's rules hold it, has the checksum megarl expects, and a changed row of a part-cut
    parameter is named."""
    if ep > 1 and "num_experts" not in hf:
        pytest.skip("dense")
    full = _tensors(hf)
    args = NO_FUSION + (["--ep-size", str(ep)] if ep > 1 else [])
    expected = ExpectedChecksums(layout_for(hf_inventory(hf), "sglang", tp, hf=hf, sglang_args=args), list(range(tp)))
    for name, t in full.items():
        expected.add(name, t)
    tensors = [_sglang_rank(hf, full, tp, rank, ep) for rank in range(tp)]
    held = {0: {rank: module_checksums(_Held(t)) for rank, t in enumerate(tensors)}}
    verify_checksums(expected.result(), held)
    assert expected.result()[(tp - 1, "model.layers.0.linear_attn.A_log")][0] == "torch.float32"

    name = "model.layers.0.linear_attn.conv1d.weight"  # its v part of the last rank
    tensors[tp - 1][name][-1] += 1
    held[0][tp - 1] = module_checksums(_Held(tensors[tp - 1]))
    with pytest.raises(WeightSyncError, match=rf"1 differ \['server 0 rank {tp - 1}: {name}"):
        verify_checksums(expected.result(), held)


def test_hybrid_settings_the_layout_cannot_serve_are_refused():
    """Sharded delivery at TP > 1 (SGLang's linear-attention loaders cut whole tensors themselves), and the MoE models
    without --disable-shared-experts-fusion (the shared expert's place would be SGLang's choice)."""
    assert check_hybrid_rollout(QWEN3_5, 1, "sharded") is None
    assert check_hybrid_rollout(QWEN3_5, 2, "full") is None
    assert "rollout.weight_delivery=full" in check_hybrid_rollout(QWEN3_5, 2, "sharded")
    assert "--disable-shared-experts-fusion" in check_hybrid_rollout(QWEN3_NEXT, 2, "full")
    assert check_hybrid_rollout(QWEN3_5_MOE, 2, "full", NO_FUSION) is None


def test_the_dry_run_refuses_them_naming_the_setting():
    from megarl.config import ConfigError
    from megarl.config.model_layout import check_rollout_model
    from megarl.config.tiny import tiny_config

    sharded = tiny_config(["rollout.engine=sglang", "rollout.sglang_tp=2", "rollout.weight_delivery=sharded",
                           "actor.parallel.world_size=2"])
    with pytest.raises(ConfigError, match=r"config.json: model_type=qwen3_5_text at rollout.sglang_tp=2: .* set "
                                          r"rollout.weight_delivery=full"):
        check_rollout_model(sharded, QWEN3_5, "config.json")
    with pytest.raises(ConfigError, match="add --disable-shared-experts-fusion to rollout.sglang_args"):
        check_rollout_model(tiny_config(["rollout.engine=sglang"]), QWEN3_5_MOE, "config.json")
    check_rollout_model(tiny_config(["rollout.engine=sglang", "rollout.sglang_args=[--disable-shared-experts-fusion]"]),
                        QWEN3_5_MOE, "config.json")
