"""Qwen2.5-VL on megatron (megarl/models/qwen2_vl.py) against transformers on the same tiny random checkpoint.

One 2-rank gloo job at TP=1 (data-parallel replicas) then TP=2: on image+text rows (one image; two images of which
one has windows cut at its edge; text only) the log-probs equal transformers' (float32, < 1e-4), and the weights
exported back to HF names are bitwise the checkpoint's (vision tower included). M-RoPE position ids equal
transformers' get_rope_index; context parallelism is refused by name.
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.qwen2_vl import mrope_positions
from tests.dist_utils import run_distributed
from tests.models.hf_qwen2_vl import IMAGE, MERGE, hf_logprobs, image_rows, save_random_qwen2_vl


def _megatron_logprobs(model_dir: str, tp: int) -> tuple[list[torch.Tensor], dict]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.engine import weights
    from megarl.engine.logprobs import vocab_parallel_logprobs
    from megarl.models import get_family
    from megarl.models.decoder import decoder_block_spec

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(1)
    hf = weights.read_hf_config(model_dir)
    family = get_family(hf)
    config = family.transformer_config(hf, tp, 1, torch.float32, use_cpu_initialization=True)
    model = family.model_class(config, decoder_block_spec(lambda i: family.layer_spec(hf, i), config),
                               **family.gpt_model_kwargs(hf, tp)).eval()
    maps = family.weight_maps(hf, tp)
    weights.load_hf_weights(model, maps, weights.SafetensorsCheckpoint(model_dir))

    rows = image_rows()
    width = max(len(r["ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(3, len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["ids"])] = torch.tensor(r["ids"])
        grid = r["image_grid_thw"] if r["image_grid_thw"] is not None else torch.zeros(0, 3, dtype=torch.long)
        positions[:, i, :len(r["ids"])] = mrope_positions(ids[i, :len(r["ids"])], grid, IMAGE, MERGE)
    with_images = [r for r in rows if r["pixel_values"] is not None]
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]  # True = masked (megatron)
    with torch.no_grad():
        logits = model(ids, positions, causal, pixel_values=torch.cat([r["pixel_values"] for r in with_images]),
                       image_grid_thw=torch.cat([r["image_grid_thw"] for r in with_images]))
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], hf["text_config"]["vocab_size"], False)
    layout = weights.PipelineLayout(model)
    hf_tensors = {n: (tuple(t.shape), t.dtype) for n, t in load_file(f"{model_dir}/model.safetensors").items()}
    exported = {n: t for bucket in weights.export_hf_weights(model, maps, layout, hf_tensors, torch.device("cpu"),
                                                             1 << 30) for n, t in bucket}
    return [logprobs[i, :len(r["ids"]) - 1] for i, r in enumerate(rows)], exported


def _check_rank(rank, model_dir, reference):
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    for tp in (1, 2):
        logprobs, exported = _megatron_logprobs(model_dir, tp)
        for i, (got, want) in enumerate(zip(logprobs, reference)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"row {i} at tp={tp}")
        assert sorted(exported) == sorted(checkpoint), f"tp={tp}"
        for name, tensor in checkpoint.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), (tp, name)


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
