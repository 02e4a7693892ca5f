"""Images in SGLang requests (megarl/rollout/sglang_images.py, sglang.py, sglang_server.py): the processor_output
payload of each row (megarl's pixel values, grids and M-RoPE positions, bitwise through JSON), its validation, the
batch request a fake SGLang server receives, and the launch arguments of a vision-language model's server."""

import importlib
import importlib.util
import json

import pytest
import torch

from megarl.models.qwen2_vl import mrope_positions
from megarl.rollout.base import ImageInputs, SamplingParams
from megarl.rollout.sglang import SGLangRolloutEngine
from megarl.rollout.sglang_images import (PROCESSOR_PACKAGE, decode_item, decode_tensor, encode_tensor, image_item,
                                          request_image_data, vision_fields)
from megarl.rollout.sglang_server import MM_ATTENTION_BACKEND, json_dumps, json_loads, sglang_server
from tests.rollout.test_sglang_engine import fake_server, log

IMAGE, START, END, MERGE = 100, 98, 99, 2


def _model_dir(tmp_path):
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "image_token_id": IMAGE,
                                                      "vision_config": {"spatial_merge_size": MERGE}}))
    return tmp_path


def _prompt(grids: list[tuple[int, int, int]]) -> tuple[list[int], ImageInputs]:
    """Text, then each image's expanded placeholder run between its start/end tokens, then text."""
    ids = [5, 6]
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // MERGE ** 2) + [END, 7]
    g = torch.Generator().manual_seed(len(grids))
    patches = sum(t * h * w for t, h, w in grids)
    return ids + [8, 9], ImageInputs(torch.randn(patches, 24, generator=g), torch.tensor(grids))


def test_payload_carries_megarls_inputs_bitwise_through_json():
    ids, images = _prompt([(1, 4, 6), (1, 2, 2)])  # two images: one item holds both
    item = image_item(ids, images, IMAGE, MERGE)
    back = decode_item(json_loads(json_dumps(item)))  # as Endpoint.post sends it
    assert back["format"] == "processor_output"
    assert torch.equal(back["pixel_values"], images.pixel_values)
    assert torch.equal(back["image_grid_thw"], images.image_grid_thw)
    positions = mrope_positions(torch.tensor(ids), images.image_grid_thw, IMAGE, MERGE)
    assert torch.equal(back["mrope_positions"], positions) and positions.shape == (3, len(ids))
    assert back["mrope_position_delta"].tolist() == [[int(positions.max()) + 1 - len(ids)]]
    resumed = image_item(ids + [11, 12, 13], images, IMAGE, MERGE)  # a partial rollout resumed: its whole input
    assert decode_tensor(resumed["mrope_positions"]).shape == (3, len(ids) + 3)
    half = torch.randn(3, 5).to(torch.bfloat16)
    assert torch.equal(decode_tensor(json.loads(json.dumps(encode_tensor(half)))), half)


def test_payload_refuses_placeholders_that_do_not_match_the_images(tmp_path):
    ids, images = _prompt([(1, 4, 4)])
    with pytest.raises(ValueError, match="needs 4 placeholder tokens"):
        image_item(ids[:4] + ids[6:], images, IMAGE, MERGE)  # two of the run's tokens missing
    with pytest.raises(ValueError, match="2 images but 1 runs"):
        image_item(ids, ImageInputs(torch.zeros(32, 24), torch.tensor([[1, 4, 4], [1, 4, 4]])), IMAGE, MERGE)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="config.json has no vision_config"):
        vision_fields(str(tmp_path))
    assert request_image_data([None, None]) is None


def test_generate_sends_one_item_per_row_and_none_for_text_rows(tmp_path):
    model = _model_dir(tmp_path / "model")
    engine = SGLangRolloutEngine(str(model), colocated=False, launch=lambda i: fake_server(tmp_path))
    try:
        text, (ids, images) = [4, 5, 6], _prompt([(1, 2, 4)])
        gens = engine.generate([text, ids], SamplingParams(max_new_tokens=3, n=2), images=[None, images])
        assert len(gens) == 4 and all(len(g.token_ids) == 3 for g in gens)
        (request,) = [e["body"] for e in log(engine.servers[0], "/generate")]
        assert request["input_ids"] == [text, text, ids, ids]  # the expanded ids as given: nothing re-tokenised
        assert request["sampling_params"]["logit_bias"] == {str(IMAGE): -1e9}  # a placeholder is never sampled
        data = request["image_data"]
        assert data[:2] == [[None], [None]] and all(len(d) == 1 for d in data)
        for row in data[2:]:
            sent = decode_item(row[0])
            assert torch.equal(sent["pixel_values"], images.pixel_values)
            assert torch.equal(sent["image_grid_thw"], images.image_grid_thw)
        engine.generate([text], SamplingParams(max_new_tokens=2))
        assert "image_data" not in log(engine.servers[0], "/generate")[-1]["body"]  # text-only calls as before
    finally:
        engine.shutdown()
    text_model = SGLangRolloutEngine("unused", colocated=False, launch=lambda i: fake_server(tmp_path))
    try:
        text_model.generate([[4, 5, 6]], SamplingParams(max_new_tokens=2))
        assert "logit_bias" not in log(text_model.servers[0], "/generate")[-1]["body"]["sampling_params"]
    finally:
        text_model.shutdown()


def test_vision_language_server_launch(tmp_path):
    model = str(_model_dir(tmp_path / "model"))
    one, two = sglang_server(model, log_dir=str(tmp_path)), sglang_server(model, tp=2, log_dir=str(tmp_path))
    assert one.command[one.command.index("--mm-attention-backend") + 1] == MM_ATTENTION_BACKEND
    assert "--mm-enable-dp-encoder" not in one.command and "--mm-enable-dp-encoder" in two.command  # tower replicated
    assert one.env["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] == PROCESSOR_PACKAGE
    # no vision-embedding cache: it would keep the old tower's features of an image across a weight sync
    assert one.env["SGLANG_VLM_CACHE_SIZE_MB"] == two.env["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    assert sglang_server(model, env={"SGLANG_VLM_CACHE_SIZE_MB": "64"}).env["SGLANG_VLM_CACHE_SIZE_MB"] == "64"
    assert importlib.util.find_spec(PROCESSOR_PACKAGE + ".qwen_vl") is not None  # the module SGLang imports
    chosen = sglang_server(model, extra_args=("--mm-attention-backend", "sdpa"), log_dir=str(tmp_path)).command
    assert chosen[len(chosen) - 1 - chosen[::-1].index("--mm-attention-backend") + 1] == "sdpa"  # the last one counts
    text = sglang_server("model", log_dir=str(tmp_path))
    assert "--mm-attention-backend" not in text.command and "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE" not in text.env
    assert "SGLANG_VLM_CACHE_SIZE_MB" not in text.env


def test_processor_loader_inside_sglang_gives_the_tokenizer_without_torchvision(tmp_path, monkeypatch):
    """What the server loads at start-up (sglang_processors/qwen_vl.py), with stand-ins for the three SGLang modules
    it imports: transformers' processor wants torchvision (absent here, maybe in the GPU bundle); the tokenizer alone
    gives SGLang the image tokens' ids."""
    import sys
    import types

    from megarl.models.tiny_vl import build_tiny_vl_tokenizer

    registry = {}
    stand_ins = {"sglang.srt.models.qwen2_5_vl": {"Qwen2_5_VLForConditionalGeneration": type("Q", (), {})},
                 "sglang.srt.multimodal.customized_mm_processor_utils": {"_CUSTOMIZED_MM_PROCESSOR": registry},
                 "sglang.srt.multimodal.processors.qwen_vl": {"QwenVLImageProcessor": type("P", (), {})}}
    for name, members in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**members))
    monkeypatch.delitem(sys.modules, PROCESSOR_PACKAGE + ".qwen_vl", raising=False)
    importlib.import_module(PROCESSOR_PACKAGE + ".qwen_vl")
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    build_tiny_vl_tokenizer().save_pretrained(tmp_path)  # a VL model directory's processor files
    Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    Qwen2_5_VLConfig().save_pretrained(tmp_path)
    processor = registry["qwen2_5_vl"].from_pretrained(str(tmp_path), use_fast=True)
    assert processor.tokenizer.convert_ids_to_tokens([IMAGE]) == ["<|image_pad|>"]
