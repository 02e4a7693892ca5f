"""Qwen3-VL on megatron (megarl/models/qwen3_vl.py) against transformers on the same tiny random checkpoint.

One 2-rank gloo job through MegatronEngine at TP=2 (the text-only row packed beside a one-image row), TP=2 with
sequence parallelism (the DeepStack features scattered over TP with the embeddings), PP=2 (the DeepStack layers on the
first stage) and PP=2 with full recompute: on the image+text rows of hf_qwen2_vl.py (one image; two images whose grids
interpolate the position embeddings; text only) the log-probs equal transformers' (float32, < 1e-4) and the weights
exported back to HF names are bitwise the checkpoint's (vision tower included); one SFT step over three micro-batches
at PP=2 gives the same weights with full recompute as without (each DeepStack layer rerun with its own micro-batch's
features). Also: the weight maps and the resharder's inventory name every checkpoint tensor once, interleaved M-RoPE
is not megatron's chunked one, a first stage without the DeepStack layers is refused by name.
Qwen3-VL-MoE (megarl/models/qwen3_vl_moe.py): the same log-probs and export at TP=2 with SP, PP=2 and EP=2; its
stacked experts named once per row and read alike from either layout; megarl.convert's round trip is bitwise.
"""

import pytest
import torch
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from safetensors.torch import load_file

from tests.dist_utils import run_distributed
from tests.models.hf_qwen2_vl import VOCAB, hf_logprobs, image_rows
from tests.models.hf_qwen3_vl import STACKED, qwen3_vl_config, save_random_qwen3_vl
from tests.models.test_qwen2_vl import vl_batch

# (tp, pp, ep, sequence_parallel, recompute, max_tokens_per_micro_batch) on 2 ranks
LAYOUTS = ((2, 1, 1, False, "none", 64), (2, 1, 1, True, "none", 0), (1, 2, 1, False, "none", 0),
           (1, 2, 1, False, "full", 0))
MOE_LAYOUTS = ((2, 1, 1, True, "none", 0), (1, 2, 1, False, "none", 0), (1, 1, 2, False, "none", 64))


def _check_rank(rank, model_dir, reference, layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
    from megarl.engine import MegatronEngine

    checkpoint = load_file(f"{model_dir}/model.safetensors")
    trained = {}
    for tp, pp, ep, sp, recompute, max_tokens in layouts:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1)
        where = f"tp={tp} pp={pp} ep={ep} sp={sp} recompute={recompute}"
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep, sequence_parallel=sp)
        actor = ActorConfig(parallel=parallel, micro_batch_size=1, max_tokens_per_micro_batch=max_tokens,
                            recompute=recompute, optim=OptimConfig(lr=1e-2))
        engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
        logprobs = engine.compute_logprobs(vl_batch(image_rows()))["logprobs"]
        for i, want in enumerate(reference):
            torch.testing.assert_close(logprobs[i, 1:len(want) + 1], want, rtol=0, atol=1e-4, msg=f"row {i} at {where}")
        exported = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
        assert sorted(exported) == sorted(checkpoint), where
        for name, tensor in checkpoint.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), (where, name)
        if pp > 1 and layouts is LAYOUTS:  # one SFT step over 3 micro-batches, the second forward before the first
            engine.train(vl_batch(image_rows()), loss="sft")  # backward (1F1B)
            trained[recompute] = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    if not trained:
        return
    # full recompute reruns each DeepStack layer with its own micro-batch's features: the same step
    changed = [n for n in checkpoint if not torch.equal(trained["none"][n], checkpoint[n])]
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in changed)
    for name in checkpoint:
        torch.testing.assert_close(trained["full"][name], trained["none"][name], rtol=0, atol=1e-6, msg=name)


def test_logprobs_equal_transformers_at_tp2_sp_and_pp2_and_weights_round_trip(tmp_path):
    model_dir = save_random_qwen3_vl(tmp_path / "vl")
    run_distributed(_check_rank, 2, model_dir, hf_logprobs(model_dir, image_rows()), LAYOUTS)


def test_moe_logprobs_equal_transformers_at_tp2_sp_pp2_ep2_and_weights_round_trip(tmp_path):
    """Qwen3-VL-MoE: the same rows and checks at TP=2 with SP, PP=2 and EP=2 (the stacked experts exported back
    bitwise in the published layout)."""
    model_dir = save_random_qwen3_vl(tmp_path / "vl", moe=True)
    run_distributed(_check_rank, 2, model_dir, hf_logprobs(model_dir, image_rows()), MOE_LAYOUTS)


def test_weight_maps_name_every_checkpoint_tensor_once_and_refusals(tmp_path):
    from megarl.models import get_family
    from megarl.models.qwen3_vl import FAMILY, Qwen3VLModel, interleaved_axes
    from megarl.reshard.inventory import hf_inventory, on_first_stage

    hf = qwen3_vl_config().to_dict()
    assert get_family(hf) is FAMILY
    checkpoint = load_file(f"{save_random_qwen3_vl(tmp_path / 'vl')}/model.safetensors")
    names = [n for m in FAMILY.weight_maps(hf, tp=2) if m.export for n in m.hf]
    assert sorted(names) == sorted(checkpoint)
    # the resharder's and planner's inventory: the same names and shapes, the tower replicated on the first stage
    specs = hf_inventory(hf)
    assert {s.name: s.shape for s in specs} == {n: tuple(t.shape) for n, t in checkpoint.items()}
    assert all(s.dim is None and on_first_stage(s) for s in specs if s.name.startswith("model.visual."))
    # interleaved: frequencies 1 and 4 follow the height, 2 and 5 the width (chunked: 4-5 height, 6-7 width)
    assert interleaved_axes([4, 2, 2], 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    config = FAMILY.transformer_config(hf, 1, 1, torch.float32, True)
    one_layer = TransformerBlockSubmodules(layer_specs=[FAMILY.layer_spec(hf, 0)])
    with pytest.raises(ValueError, match=r"first 2 language layers, which must be on the first pipeline stage; "
                                         r"it has 1"):
        Qwen3VLModel(config, one_layer, vision=hf["vision_config"], image_token_id=0, vocab_size=VOCAB,
                     max_sequence_length=64)


def test_moe_weight_maps_stack_each_expert_once_in_either_layout(tmp_path):
    """Qwen3-VL-MoE: every checkpoint tensor named, the stacked ones once per expert row; a row reads the same from
    the published (input-major) layout and from transformers 5's output-major one; the hf rollout engine's views
    of transformers' model are the checkpoint's tensors (stacked, input-major), which megarl's updates name; the
    planner's inventory lists each stacked tensor by row, and an RL config with sharded delivery is refused by key
    (the weight sync moves stacked experts whole only)."""
    from transformers import AutoModelForImageTextToText

    from megarl.config import ConfigError
    from megarl.config.model_layout import check_rollout_model
    from megarl.config.tiny import tiny_config
    from megarl.models import get_family
    from megarl.models.qwen3_vl_moe import FAMILY
    from megarl.reshard.inventory import hf_inventory
    from megarl.rollout.hf import checkpoint_views

    hf = qwen3_vl_config(moe=True).to_dict()
    assert get_family(hf) is FAMILY
    model_dir = save_random_qwen3_vl(tmp_path / "moe", moe=True)
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    maps = [m for m in FAMILY.weight_maps(hf, tp=2) if m.export]
    assert sorted({n for m in maps for n in m.hf}) == sorted(checkpoint)
    rows = sorted((m.hf[0], m.stacked) for m in maps if m.stacked)
    assert rows == sorted((n, (e, 4)) for n in checkpoint if n.endswith(STACKED) for e in range(4))
    for m in maps:
        if m.stacked:
            published = checkpoint[m.hf[0]][m.stacked[0]]
            for rank in (0, 1):
                assert torch.equal(m.to_shard([published], rank, 2), m.to_shard([published.t()], rank, 2)), m.megatron
            assert torch.equal(m.from_shards([m.to_shard([published], r, 2) for r in (0, 1)])[0], published)
    views = checkpoint_views(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32))
    assert sorted(views) == sorted(checkpoint) and all(torch.equal(views[n], t) for n, t in checkpoint.items())
    # the planner's inventory: every tensor by name and shape, each stacked one as its rows
    listed = {}
    for spec in hf_inventory(hf):
        name = spec.name.rsplit(".", 1)[0] if spec.expert is not None else spec.name
        listed.setdefault(name, []).append((spec.expert, spec.shape))
    assert sorted(listed) == sorted(checkpoint)
    for name, rows in listed.items():
        want = [(e, checkpoint[name].shape[1:]) for e in range(4)] if name.endswith(STACKED) else \
            [(None, checkpoint[name].shape)]
        assert rows == want, name
    with pytest.raises(ConfigError, match="model_type='qwen3_vl_moe' stacks .* set rollout.weight_delivery=full"):
        check_rollout_model(tiny_config([f"model.path={model_dir}", "rollout.weight_delivery=sharded"]), hf, "c")
    check_rollout_model(tiny_config([f"model.path={model_dir}"]), hf, "config.json")


def test_convert_round_trip_is_bitwise(tmp_path):
    """python -m megarl.convert hf-to-megatron then megatron-to-hf of a bf16 Qwen3-VL-MoE: every tensor bitwise, the
    vision tower, its DeepStack mergers and the stacked experts (published layout) included."""
    from tests.test_convert import convert

    model_dir = save_random_qwen3_vl(tmp_path / "vl", dtype=torch.bfloat16, moe=True)
    convert(["hf-to-megatron", model_dir, tmp_path / "ckpt"], ["megatron-to-hf", tmp_path / "ckpt", tmp_path / "back"],
            log=tmp_path / "convert.log")
    original, back = load_file(f"{model_dir}/model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and any(n.startswith("model.visual.deepstack") for n in back)
    assert any(n.endswith(".experts.gate_up_proj") for n in back)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in original.items())


def test_grpo_with_a_qwen3_vl_moe_policy_at_ep2(tmp_path, ray_local):
    """GRPO end to end on the CPU with text-only prompts: the transformers rollout engine generates with a tiny
    Qwen3-VL-MoE (its image-text-to-text class), megatron trains it at EP=2, every sync (the stacked experts gathered
    whole, input-major, from both ranks' rows) is verified by checksums, and the engine ends up holding exactly the
    trained policy."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3VLMoeForConditionalGeneration

    from megarl.models.tiny import build_char_tokenizer
    from megarl.workers import sync_checks
    from tests.models.family_grpo import grpo_then_weights

    tokenizer, config = build_char_tokenizer(), qwen3_vl_config(moe=True)
    config.text_config.vocab_size = 128  # the recipe's characters, then the vision tokens above them
    config.text_config.pad_token_id, config.text_config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id = \
        120, 121, 122, 123
    torch.manual_seed(7)
    model = tmp_path / "vl_moe"
    Qwen3VLMoeForConditionalGeneration(config).save_pretrained(model)
    file = f"{model}/model.safetensors"  # input-major stacked experts, as published
    save_file({n: t.transpose(1, 2).contiguous() if n.endswith(STACKED) else t for n, t in load_file(file).items()},
              file, metadata={"format": "pt"})
    tokenizer.save_pretrained(model)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(model)
    state, held, steps = grpo_then_weights(str(model), tmp_path / "run", [
        "actor.parallel.ep=2", "actor.micro_batch_size=4", "algorithm.entropy_coef=0.01", "trainer.steps=1",
        "trainer.eval_every=0"])  # one step: gpt-oss's test covers a sync after a second

    assert held == {n: sync_checks.tensor_digest(t) for n, t in state.items()}
    initial = load_file(file)
    assert sorted(state) == sorted(initial)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert (state[name] != initial[name]).flatten(1).any(1).all()  # every expert moved, on both EP ranks, and synced
    assert len(steps) == 1 and steps[0]["sync/verified"] == 1.0 and steps[0]["train/grad_norm"] > 0
