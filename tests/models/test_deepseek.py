"""DeepSeek-V3 / V2 (megarl/models/deepseek.py) against transformers on tiny random checkpoints (fp32, CPU, YaRN).

One 2-rank gloo job changes layout in place: TP=2, PP=2 (layer 0 on one stage, layer 1 on the other: with a dense
first layer and a MoE second one each stage builds its own layers' specs), DP=2 with packed rows (several sequences
per row: restarted positions, block-diagonal mask) under megatron's core attention, megarl's SDPA and its varlen
kernel (cu_seqlens, the layout of the GPU's flash attention), TP=2 with
sequence parallelism, and EP=2. Per case and layout: log-probs and entropy equal transformers' (< 1e-5), and the
weights exported back to HF names are bitwise the checkpoint's. A second job trains one SFT Adam step at TP=2,
with and without SP, equal to transformers + torch Adam: MLA's replicated latent norms and down projections get
whole gradients (summed over TP only under SP).
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
from megarl.models import get_family
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import deepseek_v2_config, deepseek_v3_config, save_random
from tests.models.test_families_vs_hf import _assert_like_hf_step, _hf_sft_step, sft_step

# (tp, pp, ep, sequence_parallel, max_tokens_per_micro_batch, attention) on 2 ranks
# (varlen: the GPU's default for packed rows, here its per-segment CPU kernel; multi-latent attention takes it in
# megatron's 'thd' layout)
LAYOUTS = ((2, 1, 1, False, 0, "local"), (1, 2, 1, False, 0, "local"), (1, 1, 1, False, 24, "local"),
           (1, 1, 1, False, 24, "sdpa"), (1, 1, 1, False, 24, "varlen"), (2, 1, 1, True, 24, "varlen"),
           (2, 1, 1, True, 0, "local"), (1, 1, 2, False, 0, "local"))
PACKED_TOKENS = 24  # twice the longest sequence (12): micro-batches of several sequences (default one_row layout)
ONE_LAYOUT_CASE = "v2-mscale_all_dim"  # checked at the packed layouts only: it differs in the softmax scale alone


def _relayout(tp, pp, ep):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)


def _check_rank(rank, cases):
    import torch.distributed as dist

    from megarl.engine import MegatronEngine

    for tp, pp, ep, sp, max_tokens, attention in LAYOUTS:
        _relayout(tp, pp, ep)
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep, sequence_parallel=sp)
        actor = ActorConfig(parallel=parallel, micro_batch_size=2, max_tokens_per_micro_batch=max_tokens,
                            attention=attention)
        for name, model_dir, moe, ref_logprobs, ref_entropy in cases:
            if (ep > 1 and not moe) or (name == ONE_LAYOUT_CASE and (tp, pp, max_tokens) != (1, 1, PACKED_TOKENS)):
                continue
            where = f"{name} at tp={tp} pp={pp} ep={ep} sp={sp} max_tokens={max_tokens} attention={attention}"
            engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
            assert engine.core_attention == attention, where
            if max_tokens:
                assert any(mb["packed"] for mb in engine._micro_batches(padded_batch(), [])), where
            out = engine.compute_logprobs(padded_batch(), with_entropy=True)
            torch.testing.assert_close(out["logprobs"], ref_logprobs, rtol=0, atol=1e-5, msg=where)
            torch.testing.assert_close(out["entropy"], ref_entropy, rtol=0, atol=1e-5, msg=where)
            exported = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
            checkpoint = load_file(f"{model_dir}/model.safetensors")
            assert sorted(exported) == sorted(checkpoint), where
            for key, tensor in checkpoint.items():
                assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (where, key)


def _v2_with_mscale_all_dim(tmp_path):
    """A V2 checkpoint whose YaRN sets mscale_all_dim, and its reference: the same weights in transformers'
    DeepseekV3 classes, which (like DeepSeek's code and SGLang) multiply the softmax scale by mscale^2;
    transformers' DeepseekV2Attention leaves that factor out."""
    v2 = deepseek_v2_config(rope_parameters={**deepseek_v2_config().rope_parameters, "mscale_all_dim": 0.8})
    model_dir = save_random(v2, tmp_path / "v2-mscale", seed=3)
    fields = {k: getattr(v2, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank",
                                          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                          "max_position_embeddings", "first_k_dense_replace", "rope_parameters")}
    as_v3 = DeepseekV3ForCausalLM(DeepseekV3Config(**fields, architectures=["DeepseekV3ForCausalLM"]))
    as_v3.load_state_dict(load_file(f"{model_dir}/model.safetensors"), strict=True)
    as_v3.save_pretrained(tmp_path / "v2-mscale-as-v3")
    reference = hf_logprobs_entropy(str(tmp_path / "v2-mscale-as-v3"), padded_batch())
    transformers_v2 = hf_logprobs_entropy(model_dir, padded_batch())
    assert (transformers_v2[0] - reference[0]).abs().max() > 1e-2  # the scales differ, visibly
    return model_dir, reference


def test_deepseek_matches_transformers_at_tp_pp_ep_packed(tmp_path):
    # layer 0 dense, layer 1 mixture of experts (A2's deepseek_moe.py); the V2 one with tied embeddings
    configs = {"v3": deepseek_v3_config(first_k_dense_replace=1),
               "v2": deepseek_v2_config(first_k_dense_replace=1, tied=True)}
    cases = []
    for seed, (name, config) in enumerate(configs.items()):
        model_dir = save_random(config, tmp_path / name, seed=seed)
        cases.append((name, model_dir, True, *hf_logprobs_entropy(model_dir, padded_batch())))
    model_dir, reference = _v2_with_mscale_all_dim(tmp_path)  # every layer dense
    cases.append((ONE_LAYOUT_CASE, model_dir, False, *reference))

    run_distributed(_check_rank, 2, cases, timeout=300)


def test_every_parameter_has_a_map_and_the_down_projections_are_replicated():
    hf = deepseek_v3_config(first_k_dense_replace=1).to_dict()
    maps = {m.megatron: m for m in get_family(hf).weight_maps(hf, tp=2)}
    attn = "decoder.layers.1.self_attention."
    full = {n: torch.randn(s) for n, s in [("q_a", (24, 32)), ("q_b", (4 * 20, 24)), ("kv_b", (4 * 22, 16)),
                                           ("o", (32, 4 * 10))]}
    # q_a (down) whole on each rank; q_b / kv_b whole heads per rank; o_proj split by input (the heads' values)
    assert torch.equal(maps[attn + "linear_q_down_proj.weight"].to_shard([full["q_a"]], 1, 2), full["q_a"])
    assert torch.equal(maps[attn + "linear_q_up_proj.weight"].to_shard([full["q_b"]], 1, 2), full["q_b"][40:])
    assert torch.equal(maps[attn + "linear_kv_up_proj.weight"].to_shard([full["kv_b"]], 0, 2), full["kv_b"][:44])
    assert torch.equal(maps[attn + "linear_proj.weight"].to_shard([full["o"]], 1, 2), full["o"][:, 20:])
    assert maps[attn + "kv_layernorm.weight"].hf == ("model.layers.1.self_attn.kv_a_layernorm.weight",)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in maps and "decoder.layers.1.mlp.router.weight" in maps
    v2 = deepseek_v2_config().to_dict()
    v2_maps = {m.megatron for m in get_family(v2).weight_maps(v2, tp=1)}
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in v2_maps
    assert not any("q_down" in n or "q_layernorm" in n for n in v2_maps)


def test_mla_config_and_latent_norms():
    family = get_family(deepseek_v3_config().to_dict())
    config = family.transformer_config(deepseek_v3_config().to_dict(), 2, 1, torch.float32, True)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (24, 16, 12, 8, 10)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == ("yarn", 4.0, 1.0, 0.8)
    # the latent norms come from the spec; qk_layernorm stays off so megatron does not sum their grads over TP
    assert not config.qk_layernorm
    spec = family.layer_spec(deepseek_v3_config().to_dict(), 0).submodules.self_attention.submodules
    assert spec.q_layernorm.__name__ == spec.kv_layernorm.__name__ == "LatentNorm"


@pytest.mark.parametrize("change, key", [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": {**deepseek_v3_config().rope_parameters, "attention_factor": 1.0}}, "attention_factor"),
    ({"rope_parameters": {**deepseek_v3_config().rope_parameters, "mscale": 0.5, "mscale_all_dim": 0.0}}, "mscale"),
    ({"rope_parameters": {**deepseek_v3_config().rope_parameters, "truncate": False}}, "truncate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_settings_fail_naming_the_key(change, key):
    hf = {**deepseek_v3_config().to_dict(), **change}
    with pytest.raises(ValueError, match=key):
        get_family(hf).transformer_config(hf, 1, 1, torch.float32, True)


def test_tp_must_divide_the_heads_and_unknown_model_types_still_fail():
    hf = deepseek_v3_config().to_dict()
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        get_family(hf).transformer_config(hf, 8, 1, torch.float32, True)
    with pytest.raises(ValueError, match="deepseek_v4"):
        get_family({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]})


def _train_rank(rank, model_dir):
    import torch.distributed as dist

    trained = {}
    for sp in (False, True):
        _relayout(2, 1, 1)
        trained[sp] = sft_step(model_dir, ParallelConfig(world_size=dist.get_world_size(), tp=2, sequence_parallel=sp))
    return trained


def test_deepseek_sft_step_at_tp2_with_and_without_sp_equals_transformers(tmp_path):
    model_dir = save_random(deepseek_v3_config(), tmp_path / "v3", seed=5)
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(model_dir, tmp_path / "hf-step")

    trained = run_distributed(_train_rank, 2, model_dir, timeout=240)

    assert sorted(trained) == [False, True]
    _assert_like_hf_step({("tp=2", "sp"): trained[True], ("tp=2",): trained[False]}, ref_loss, ref_grad_norm,
                         ref_weights)
