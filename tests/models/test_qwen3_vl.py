"""Qwen3-VL on megatron (megarl/models/qwen3_vl.py) against transformers on the same tiny random checkpoint.

One 2-rank gloo job through MegatronEngine at TP=2 (the text-only row packed beside a one-image row), TP=2 with
sequence parallelism (the DeepStack features scattered over TP with the embeddings), PP=2 (the DeepStack layers on the
first stage) and PP=2 with full recompute: on the image+text rows of hf_qwen2_vl.py (one image; two images whose grids
interpolate the position embeddings; text only) the log-probs equal transformers' (float32, < 1e-4) and the weights
exported back to HF names are bitwise the checkpoint's (vision tower included); one SFT step over three micro-batches
at PP=2 gives the same weights with full recompute as without (each DeepStack layer rerun with its own micro-batch's
features). Also: the weight maps and the resharder's inventory name every checkpoint tensor once, interleaved M-RoPE
is not megatron's chunked one, a first stage without the DeepStack layers is refused by name, and megarl.convert's
round trip is bitwise.
"""

import pytest
import torch
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from safetensors.torch import load_file

from tests.dist_utils import run_distributed
from tests.models.hf_qwen2_vl import VOCAB, hf_logprobs, image_rows
from tests.models.hf_qwen3_vl import qwen3_vl_config, save_random_qwen3_vl
from tests.models.test_qwen2_vl import vl_batch

# (tp, pp, sequence_parallel, recompute, max_tokens_per_micro_batch) on 2 ranks
LAYOUTS = ((2, 1, False, "none", 64), (2, 1, True, "none", 0), (1, 2, False, "none", 0), (1, 2, False, "full", 0))


def _check_rank(rank, model_dir, reference):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
    from megarl.engine import MegatronEngine

    checkpoint = load_file(f"{model_dir}/model.safetensors")
    trained = {}
    for tp, pp, sp, recompute, max_tokens in LAYOUTS:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, pp)
        model_parallel_cuda_manual_seed(1)
        where = f"tp={tp} pp={pp} sp={sp} recompute={recompute}"
        parallel = ParallelConfig(world_size=dist.get_world_size(), tp=tp, pp=pp, sequence_parallel=sp)
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
        if pp > 1:  # one SFT step over 3 micro-batches, the second forward before the first backward (1F1B)
            engine.train(vl_batch(image_rows()), loss="sft")
            trained[recompute] = {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}
    # full recompute reruns each DeepStack layer with its own micro-batch's features: the same step
    changed = [n for n in checkpoint if not torch.equal(trained["none"][n], checkpoint[n])]
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in changed)
    for name in checkpoint:
        torch.testing.assert_close(trained["full"][name], trained["none"][name], rtol=0, atol=1e-6, msg=name)


def test_logprobs_equal_transformers_at_tp2_sp_and_pp2_and_weights_round_trip(tmp_path):
    model_dir = save_random_qwen3_vl(tmp_path / "vl")
    run_distributed(_check_rank, 2, model_dir, hf_logprobs(model_dir, image_rows()))


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


def test_convert_round_trip_is_bitwise(tmp_path):
    """python -m megarl.convert hf-to-megatron then megatron-to-hf, in bf16: every tensor, vision tower included."""
    from tests.test_convert import convert

    model_dir = save_random_qwen3_vl(tmp_path / "vl", dtype=torch.bfloat16)
    convert("hf-to-megatron", model_dir, tmp_path / "ckpt")
    convert("megatron-to-hf", tmp_path / "ckpt", tmp_path / "back")
    original, back = load_file(f"{model_dir}/model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and any(n.startswith("model.visual.deepstack") for n in back)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in original.items())
