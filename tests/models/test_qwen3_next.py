"""Qwen3-Next and Qwen3.5-MoE (models/qwen3_next.py) on megatron against transformers' own classes, on the CPU.

- The weight maps and the resharder's inventory name every checkpoint tensor once, with its shape (Qwen3-Next's
  grouped in_proj_qkvz / in_proj_ba, the shared expert and its gate); TP=2 shards put back together bitwise; the
  router and shared-expert settings; dense layers refused (TP=2: tests/models/test_qwen3_5.py); the planner sizes the model and caches keys in
  the full-attention layers only.
- One 2-rank gloo job at DP=2, PP=2 and EP=2: log-probs and entropy equal transformers' (float32), the exported
  weights are bitwise the checkpoint's; at EP=2 one SFT Adam step gives transformers' loss, grad norm and weights
  (the shared expert's gate and the experts split over EP included).
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
from megarl.models import get_family
from megarl.models.qwen3_next import FAMILY as qwen3_next
from megarl.reshard.plan import kv_bytes_per_token, main
from tests.dist_utils import run_distributed
from tests.engine.hf_models import hf_logprobs_entropy, padded_batch
from tests.models.hf_families import qwen3_next_config, save_random
from tests.models.test_family_mapping import assert_names_and_tp2_shards
from tests.models.test_families_vs_hf import _assert_like_hf_step, _hf_sft_step, assert_like_hf, sft_step

# (pp, ep) on 2 ranks: DP=2, PP=2, EP=2 (with DP=2)
LAYOUTS = ((1, 1), (2, 1), (1, 2))
MODELS = {"qwen3_next": False, "qwen3_5_moe_text": True}  # model_type -> qwen3_next_config's moe_text


@pytest.mark.parametrize("model_type", MODELS)
def test_weight_maps_inventory_and_translation(model_type, tmp_path, capsys):
    config = qwen3_next_config(MODELS[model_type])
    hf = config.to_dict()
    assert hf["model_type"] == model_type and get_family(hf) is qwen3_next
    assert get_family({"model_type": model_type}) is qwen3_next
    save_random(config, tmp_path)
    saved = load_file(f"{tmp_path}/model.safetensors")
    assert "model.layers.0.mlp.shared_expert_gate.weight" in saved
    assert ("model.layers.0.linear_attn.in_proj_qkvz.weight" in saved) == (model_type == "qwen3_next")
    assert_names_and_tp2_shards(qwen3_next, hf, saved)

    c = qwen3_next.transformer_config(hf, 1, 1, torch.float32, True, ep=2)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 16)
    assert c.moe_shared_expert_gate and c.moe_shared_expert_intermediate_size == 24
    assert c.moe_router_pre_softmax is False  # renormalised: top-k of the logits, softmax over those
    assert qwen3_next.transformer_config(hf, 2, 1, torch.float32, True).tensor_model_parallel_size == 2

    # layers linear, full: 1 full-attention layer x (K, V) x 2 heads x 16 x bf16
    assert kv_bytes_per_token(hf, 1) == 1 * 2 * 2 * 16 * 2
    main(["--model", f"{tmp_path}/config.json", "--train", "tp=1,pp=1,dp=2,ep=2", "--gen", "tp=2"])
    assert "actor.parallel.ep=2" in capsys.readouterr().out


def test_qwen3_next_settings_refused_or_read():
    hf = qwen3_next_config().to_dict()
    for dense in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [1]}):
        with pytest.raises(ValueError, match="dense layers"):
            qwen3_next.transformer_config(hf | dense, 1, 1, torch.float32, True)
    unnormalised = qwen3_next.transformer_config(hf | {"norm_topk_prob": False}, 1, 1, torch.float32, True)
    assert unnormalised.moe_router_pre_softmax is True


def _check_rank(rank, cases):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.engine import MegatronEngine

    trained = {}
    for pp, ep in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, pp, expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1)
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=1, pp=pp, ep=ep)
        for name, model_dir, ref_logprobs, ref_entropy in cases:
            where = f"{name} pp={pp} ep={ep}"
            engine = MegatronEngine(model_dir, ActorConfig(parallel=parallel, micro_batch_size=2), AlgorithmConfig(),
                                    "cpu", 1, 10)
            assert_like_hf(engine, ref_logprobs, ref_entropy, model_dir, where)
            if ep > 1 and name == "qwen3_next":
                trained[where] = sft_step(model_dir, parallel)
    return trained


def test_qwen3_next_and_qwen3_5_moe_match_transformers_at_dp2_pp2_ep2(tmp_path):
    cases = []
    for name, moe_text in MODELS.items():
        model_dir = save_random(qwen3_next_config(moe_text), tmp_path / name, seed=3)
        cases.append((name, model_dir, *hf_logprobs_entropy(model_dir, padded_batch())))
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(cases[0][1], tmp_path / "hf-step")

    trained = run_distributed(_check_rank, 2, cases, timeout=300)

    assert sorted(trained) == ["qwen3_next pp=1 ep=2"]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)
