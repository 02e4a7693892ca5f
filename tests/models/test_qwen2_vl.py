"""Qwen2.5-VL on megatron (megarl/models/qwen2_vl.py) against transformers on the same tiny random checkpoint.

One 2-rank gloo job through MegatronEngine at TP=1 (data-parallel replicas, a sequence per row) then TP=2 (the
text-only row packed beside a one-image row) and TP=2 with sequence parallelism: on image+text rows (one image; two images of which
one has windows cut at its edge; text only) the log-probs equal transformers' (float32, < 1e-4), and the weights
exported back to HF names are bitwise the checkpoint's (vision tower included). M-RoPE position ids equal
transformers' get_rope_index; context parallelism is refused by name.
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.qwen2_vl import mrope_positions
from megarl.protocol import Batch
from tests.dist_utils import run_distributed
from tests.models.hf_qwen2_vl import IMAGE, MERGE, VOCAB, hf_logprobs, image_rows, save_random_qwen2_vl


def vl_batch(rows: list[dict]) -> Batch:
    """Right-padded token rows with each row's images as per-row fields (None: no image)."""
    width = max(len(r["ids"]) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r["ids"])], mask[i, :len(r["ids"])] = torch.tensor(r["ids"]), 1
    return Batch({"tokens": tokens, "attention_mask": mask, "loss_mask": mask.float()},
                 {"pixel_values": [r["pixel_values"] for r in rows],
                  "image_grid_thw": [r["image_grid_thw"] for r in rows]})


def _engine_logprobs(model_dir: str, tp: int, max_tokens: int, sp: bool, packing: str) -> tuple[torch.Tensor, dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.config import ActorConfig, AlgorithmConfig, ParallelConfig
    from megarl.engine import MegatronEngine

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(1)
    actor = ActorConfig(parallel=ParallelConfig(world_size=dist.get_world_size(), tp=tp, sequence_parallel=sp),
                        micro_batch_size=2, max_tokens_per_micro_batch=max_tokens, packing=packing)
    engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
    logprobs = engine.compute_logprobs(vl_batch(image_rows()))["logprobs"]
    return logprobs, {n: t for bucket in engine.export_hf_weights(1 << 30) for n, t in bucket}


def _train_step_changes(model_dir: str, freeze: bool) -> tuple[bool, bool]:
    """After one SFT step at TP=2: (did the vision tower change, did the language model change)."""
    import torch.distributed as dist

    from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig, ParallelConfig
    from megarl.engine import MegatronEngine

    actor = ActorConfig(parallel=ParallelConfig(world_size=dist.get_world_size(), tp=2), micro_batch_size=2,
                        optim=OptimConfig(lr=1e-2), freeze_vision_tower=freeze)
    engine = MegatronEngine(model_dir, actor, AlgorithmConfig(), "cpu", 1, 10)
    before = {n: p.detach().clone() for n, p in engine.gpt.named_parameters()}
    engine.train(vl_batch(image_rows()), loss="sft")
    changed = {n: not torch.equal(p, before[n]) for n, p in engine.gpt.named_parameters()}
    return (any(c for n, c in changed.items() if n.startswith("visual.")),
            all(c for n, c in changed.items() if n.startswith("decoder.layers.")))


def _check_rank(rank, model_dir, reference):
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    # TP=1: one sequence per row; TP=2: the text-only row packed beside the one-image row; TP=2 with sequence
    # parallelism (the image features scattered over TP with the embeddings); one row per micro-batch holding
    # both rows and their images, under sequence parallelism
    for tp, max_tokens, sp, packing in ((1, 0, False, "rows"), (2, 64, False, "rows"), (2, 0, True, "rows"),
                                        (2, 96, True, "one_row")):
        logprobs, exported = _engine_logprobs(model_dir, tp, max_tokens, sp, packing)
        for i, want in enumerate(reference):
            got = logprobs[i, 1:len(want) + 1]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"row {i} at tp={tp}")
        assert sorted(exported) == sorted(checkpoint), f"tp={tp}"
        for name, tensor in checkpoint.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), (tp, name)
    # the tower learns through the language model's gradient at TP=2, and actor.freeze_vision_tower stops it
    assert _train_step_changes(model_dir, freeze=False) == (True, True)
    assert _train_step_changes(model_dir, freeze=True) == (False, True)


def test_logprobs_equal_transformers_at_tp1_and_tp2_and_weights_round_trip(tmp_path):
    model_dir = save_random_qwen2_vl(tmp_path / "vl")
    reference = hf_logprobs(model_dir, image_rows())
    run_distributed(_check_rank, 2, model_dir, reference)


def test_mrope_positions_equal_transformers_rope_index(tmp_path):
    from transformers import Qwen2_5_VLModel

    from tests.models.hf_qwen2_vl import qwen2_vl_config

    row = image_rows()[1]
    ids = torch.tensor([row["ids"]])
    want, _ = Qwen2_5_VLModel.get_rope_index(
        type("M", (), {"config": qwen2_vl_config(), "get_vision_position_ids": Qwen2_5_VLModel.get_vision_position_ids})(),
        ids, (ids == IMAGE).int(), image_grid_thw=row["image_grid_thw"])
    assert torch.equal(mrope_positions(ids[0], row["image_grid_thw"], IMAGE, MERGE), want[:, 0])
    with pytest.raises(ValueError, match=r"image 1 \(grid \[1, 6, 4\]\) needs 6 placeholder tokens at position 16; the sequence has 4"):
        mrope_positions(ids[0, :20], row["image_grid_thw"], IMAGE, MERGE)


def test_convert_round_trip_is_bitwise(tmp_path):
    """python -m megarl.convert hf-to-megatron then megatron-to-hf: every tensor, vision tower included, bitwise."""
    from tests.test_convert import convert

    model_dir = save_random_qwen2_vl(tmp_path / "vl")
    convert(["hf-to-megatron", model_dir, tmp_path / "ckpt"], ["megatron-to-hf", tmp_path / "ckpt", tmp_path / "back"],
            log=tmp_path / "convert.log")
    original, back = load_file(f"{model_dir}/model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and any(n.startswith("visual.") for n in back)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in original.items())


def test_context_parallelism_is_refused_by_name():
    import dataclasses

    from megarl.models.qwen2_vl import FAMILY, Qwen2VLModel
    from tests.models.hf_qwen2_vl import qwen2_vl_config

    hf = qwen2_vl_config().to_dict()
    config = dataclasses.replace(FAMILY.transformer_config(hf, 1, 1, torch.float32, True), context_parallel_size=2)
    with pytest.raises(ValueError, match=r"actor.parallel.cp=2: context parallelism with M-RoPE \(Qwen2.5-VL\)"):
        Qwen2VLModel(config, None, vision=hf["vision_config"], image_token_id=IMAGE, vocab_size=VOCAB,
                     max_sequence_length=64)
