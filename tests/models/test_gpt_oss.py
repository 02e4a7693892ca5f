"""gpt-oss (megarl/models/gpt_oss.py) against transformers' GptOssForCausalLM: the weight names, the MXFP4 import,
the refusals, and log-probs / entropy / export at every layout in one 2-rank gloo job."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
from megarl.engine.attention import resolve_core_attention
from megarl.models import get_family
from megarl.models.hf_checkpoint import MXFP4, SafetensorsCheckpoint
from tests.dist_utils import run_distributed
from tests.engine.hf_models import VOCAB, hf_logprobs_entropy, padded_batch
from tests.models.test_families_vs_hf import ADAM_EPS, LR, _assert_like_hf_step, _hf_sft_step

# (tp, pp, ep, sequence_parallel) on 2 ranks; experts never split over TP (megatron takes expert biases at ETP=1)
LAYOUTS = ((2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (2, 1, 1, True))


def gpt_oss_config(**overrides) -> GptOssConfig:
    """2 layers, one sliding (a 4-token window, shorter than padded_batch's rows) and one full; 4 experts, top 2;
    YaRN whose correction range ends between two of the 4 frequencies of head_dim 8 (truncate=true would round it;
    max_position_embeddings = factor x original_max_position_embeddings, as transformers expects)."""
    params = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, head_dim=8, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
                  rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                       truncate=False, original_max_position_embeddings=2048),
                  architectures=["GptOssForCausalLM"])
    return GptOssConfig(**(params | overrides))


def save_random(path, seed: int = 0, **overrides) -> str:
    """Weights large enough that the experts' clamp at 7 bites and routing is far from uniform."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(gpt_oss_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for expert in (layer.mlp.experts for layer in model.model.layers):
            expert.gate_up_proj.mul_(20.0)
    model.save_pretrained(path)
    return str(path)


def test_weight_maps_cover_the_checkpoint_and_split_experts_interleaved(tmp_path):
    model_dir = save_random(tmp_path / "m")
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    maps = get_family(hf).weight_maps(hf, tp=2)
    # every checkpoint tensor once: a stacked tensor by one map per expert, each naming its own row
    singles = [n for m in maps if m.export and m.stacked is None for n in m.hf]
    stacked = {}
    for m in maps:
        if m.stacked is not None:
            stacked.setdefault(m.hf, []).append(m.stacked)
    assert all(rows == [(e, 4) for e in range(4)] for rows in stacked.values())
    assert sorted(singles + [n for names in stacked for n in names]) == sorted(checkpoint)

    by_name = {m.megatron: m for m in maps}
    gate_up = checkpoint["model.layers.0.mlp.experts.gate_up_proj"][2]  # [hidden, 2 x intermediate], interleaved
    fc1 = by_name["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    full = fc1.to_shard([gate_up], 0, 1)
    assert torch.equal(full[:24], gate_up[:, 0::2].t()) and torch.equal(full[24:], gate_up[:, 1::2].t())
    shards = [fc1.to_shard([gate_up], r, 2) for r in range(2)]  # [gate rows; up rows] of each rank's half
    assert torch.equal(shards[1], torch.cat([gate_up[:, 0::2].t()[12:], gate_up[:, 1::2].t()[12:]]))
    assert torch.equal(fc1.from_shards(shards)[0], gate_up)
    bias = checkpoint["model.layers.0.mlp.experts.gate_up_proj_bias"][2]
    fc1_bias = by_name["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.bias"]
    assert torch.equal(fc1_bias.to_shard([bias], 0, 1), torch.cat([bias[0::2], bias[1::2]]))
    sinks = by_name["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert sinks.hf == ("model.layers.1.self_attn.sinks",)


def test_mxfp4_checkpoint_reads_as_transformers_dequantizes(tmp_path):
    """A checkpoint in the published format: the experts' weights as uint8 *_blocks / *_scales (random codes, scales
    around 2^0), quant_method mxfp4; read whole and by row, they are transformers' own dequantization."""
    experts, out, groups = 4, 6, 2
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (experts, out, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(122, 133, (experts, out, groups), dtype=torch.uint8, generator=g)
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({name + "_blocks": blocks, name + "_scales": scales, "model.norm.weight": torch.ones(3)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G x 32, out]

    assert checkpoint.shapes == {name: (experts, groups * 32, out), "model.norm.weight": (3,)}
    assert torch.equal(checkpoint.read(name), reference)
    assert torch.equal(checkpoint.read(name, 2), reference[2])
    # a code's value: byte 0x7A holds codes 0xA (-1.0, first) and 0x7 (6.0), scale 128 doubles them
    one = MXFP4.dequantize(torch.tensor([[[0x7A] + [0] * 15]], dtype=torch.uint8), torch.tensor([[128]],
                           dtype=torch.uint8), "x")
    assert one[:2, 0].tolist() == [-2.0, 12.0]
    with pytest.raises(ValueError, match="uint8"):
        MXFP4.dequantize(blocks.float(), scales, name)


def test_refusals_name_the_setting():
    family = get_family({"model_type": "gpt_oss"})
    hf = gpt_oss_config().to_dict()
    with pytest.raises(ValueError, match="actor.parallel.etp=1"):
        family.transformer_config(hf, 2, 1, torch.float32, True, etp=2)
    with pytest.raises(ValueError, match="yarn only"):
        family.check_supported(hf | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="swiglu_limit=8"):
        family.check_supported(hf | {"swiglu_limit": 8.0})
    family.check_supported(hf | {"swiglu_limit": 7.0})  # the published config.json's
    with pytest.raises(ValueError, match="layer_types"):
        family.check_supported(hf | {"layer_types": ["sliding_attention", "chunked_attention"]})
    with pytest.raises(ValueError, match="actor.attention='varlen'"):
        resolve_core_attention("varlen", "cuda", 1, family.name if family.local_attention_only else None)
    assert resolve_core_attention("auto", "cuda", 1, family.name) == "local"


def _check_rank(rank, model_dir, ref_logprobs, ref_entropy):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.engine import MegatronEngine

    checkpoint = load_file(f"{model_dir}/model.safetensors")
    trained = {}
    for tp, pp, ep, sp in LAYOUTS:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        model_parallel_cuda_manual_seed(1)
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep, etp=1, sequence_parallel=sp)
        # rows of 24 tokens hold several sequences: the window must keep to each one's block of the mask
        actor = ActorConfig(parallel=parallel, micro_batch_size=2, max_tokens_per_micro_batch=24)
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        out = engine.compute_logprobs(padded_batch(), with_entropy=True)
        where = f"tp={tp} pp={pp} ep={ep} sp={sp}"
        torch.testing.assert_close(out["logprobs"], ref_logprobs, rtol=0, atol=1e-5, msg=where)
        torch.testing.assert_close(out["entropy"], ref_entropy, rtol=0, atol=1e-5, msg=where)
        exported = {name: t for bucket in engine.export_hf_weights(1 << 30) for name, t in bucket}
        assert sorted(exported) == sorted(checkpoint), where
        for key, tensor in checkpoint.items():
            assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (where, key)
        if tp > 1 and not sp:
            continue  # megatron refuses MoE training at TP > 1 without sequence parallelism
        actor = dataclasses.replace(actor, optim=OptimConfig(lr=LR, adam_eps=ADAM_EPS, clip_grad=0.0))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        batch = padded_batch(rows=8)
        metrics = engine.train(batch.chunk(parallel_state.get_data_parallel_world_size())[
            parallel_state.get_data_parallel_rank()], loss="sft")
        trained[(tp, pp, ep, sp)] = (metrics, {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket})
    return trained


def test_gpt_oss_matches_transformers_at_tp_pp_ep_sp(tmp_path):
    """Sinks, a window shorter than the rows (sequences packed into rows of 24 tokens), YaRN, the biased router and
    the clamped, interleaved experts: log-probs and entropy as transformers' (eager attention) at TP=2, PP=2, EP=2 and
    TP=2 with SP, the export bitwise the checkpoint's; one SFT Adam step as transformers + torch.optim.Adam's at PP=2,
    EP=2 and TP=2 with SP (the sinks' gradients split by head, the router's and the experts' biases)."""
    model_dir = save_random(tmp_path / "gpt-oss", seed=41)
    ref_loss, ref_grad_norm, ref_weights = _hf_sft_step(model_dir, tmp_path / "hf-step")
    trained = run_distributed(_check_rank, 2, model_dir, *hf_logprobs_entropy(model_dir, padded_batch()), timeout=300)
    assert sorted(trained) == [(1, 1, 2, False), (1, 2, 1, False), (2, 1, 1, True)]
    _assert_like_hf_step(trained, ref_loss, ref_grad_norm, ref_weights)

def test_convert_round_trip_reads_mxfp4_and_writes_bf16_bitwise(tmp_path):
    """A bf16 gpt-oss whose down_proj is stored as MXFP4 (random codes and scales, quant_method mxfp4; intermediate
    size 32, one block a row) through `python -m megarl.convert` hf-to-megatron and megatron-to-hf: every other
    tensor (the stacked, interleaved gate_up_proj, the sinks, the biases) bit for bit, down_proj as transformers
    dequantizes it, and a config.json without quantization_config that transformers loads as gpt-oss again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.test_convert import convert

    hf = tmp_path / "hf"
    AutoModelForCausalLM.from_pretrained(save_random(tmp_path / "fp32", seed=5, intermediate_size=32),
                                         dtype=torch.bfloat16).save_pretrained(hf)
    original = load_file(hf / "model.safetensors")
    tensors, expected = dict(original), dict(original)
    g = torch.Generator().manual_seed(1)
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.experts.down_proj"
        experts, _, hidden = tensors.pop(name).shape  # [E, intermediate, hidden] = [E, 1 x 32, hidden]
        blocks = torch.randint(0, 256, (experts, hidden, 1, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 130, (experts, hidden, 1), dtype=torch.uint8, generator=g)
        tensors |= {name + "_blocks": blocks, name + "_scales": scales}
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "mxfp4"}}))

    convert(["hf-to-megatron", hf, tmp_path / "imported"], ["megatron-to-hf", tmp_path / "imported", tmp_path / "back"],
            log=tmp_path / "convert.log")

    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == expected.keys() and {t.dtype for t in back.values()} == {torch.bfloat16}
    assert all(torch.equal(back[n], expected[n]) for n in expected)
    assert not torch.equal(back["model.layers.0.mlp.experts.down_proj"], original["model.layers.0.mlp.experts.down_proj"])
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in written
    assert written["swiglu_limit"] == 7.0  # SGLang reads it; transformers' writer drops it
    assert AutoConfig.from_pretrained(tmp_path / "back").model_type == "gpt_oss"


def test_inventory_lists_each_expert_as_its_row_and_rl_refuses_what_the_sync_cannot(tmp_path):
    """The planner's inventory: the checkpoint's tensors by name and shape, each stacked expert tensor as its E rows
    (`<name>.{e}`), and whole as the transformers engine holds them (stacked_whole); an RL config is refused before
    any worker starts where the sync cannot move or check them, naming the key, and taken otherwise."""
    from megarl.config import ConfigError
    from megarl.config.model_layout import check_rollout_model
    from megarl.config.tiny import tiny_config
    from megarl.reshard.inventory import hf_inventory, stacked_whole

    model_dir = save_random(tmp_path / "m")
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    shapes = {n: tuple(t.shape) for n, t in load_file(f"{model_dir}/model.safetensors").items()}
    listed = {}
    for spec in hf_inventory(hf):
        name = spec.name.rsplit(".", 1)[0] if spec.expert is not None else spec.name
        listed.setdefault(name, []).append((spec.expert, spec.shape))
    assert sorted(listed) == sorted(shapes)
    for name, rows in listed.items():
        if rows[0][0] is None:
            assert rows == [(None, shapes[name])], name
        else:
            assert rows == [(e, shapes[name][1:]) for e in range(4)], name
    assert {s.name: s.shape for s in stacked_whole(hf_inventory(hf))} == shapes
    with pytest.raises(ConfigError, match="set rollout.weight_delivery=full"):
        check_rollout_model(tiny_config([f"model.path={model_dir}", "rollout.weight_delivery=sharded"]), hf, "c")
    with pytest.raises(ConfigError, match="trainer.verify_weight_sync_deep=true"):
        check_rollout_model(tiny_config([f"model.path={model_dir}", "rollout.engine=sglang",
                                         "trainer.verify_weight_sync_every=1"]), hf, "c")
    for taken in (["trainer.verify_weight_sync_every=1"],
                  ["rollout.engine=sglang", "trainer.verify_weight_sync_every=0"]):
        check_rollout_model(tiny_config([f"model.path={model_dir}", *taken]), hf, "c")


def test_grpo_with_a_gpt_oss_policy_at_ep2(tmp_path, ray_local):
    """GRPO end to end on the CPU: the transformers rollout engine generates with a tiny gpt-oss, megatron trains it
    at EP=2 (each rank half the experts), every sync (each stacked expert tensor gathered whole from both ranks'
    rows) is verified by checksums, and the engine ends up holding exactly the trained policy."""
    from megarl.workers import sync_checks
    from tests.models.family_grpo import grpo_then_weights
    from tests.models.hf_families import save_random_for_recipe

    model = save_random_for_recipe(gpt_oss_config(), tmp_path / "gpt_oss", seed=3)
    state, held, steps = grpo_then_weights(model, tmp_path / "run", [
        "actor.parallel.ep=2", "actor.micro_batch_size=4",
        "algorithm.entropy_coef=0.01"])  # a random policy earns no reward: the entropy bonus moves the weights

    assert held == {n: sync_checks.tensor_digest(t) for n, t in state.items()}
    initial = load_file(f"{model}/model.safetensors")
    assert sorted(state) == sorted(initial)
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj"):  # moved in both EP ranks' halves, and synced
        moved = (state[f"model.layers.0.mlp.experts.{name}"] != initial[f"model.layers.0.mlp.experts.{name}"])
        assert moved.flatten(1).any(1).all(), name
    assert len(steps) == 2 and all(r["sync/verified"] == 1.0 and r["train/grad_norm"] > 0 for r in steps)
