"""Prompt rows with images (megarl/data/images.py) for the tiny Qwen2.5-VL (megarl/models/tiny_vl.py): expanded
placeholder ids, the processor's pixel values, masked out of the loss; missing or unreadable images named by file,
row and image."""

import base64
import io
import json

import pytest
import torch
from PIL import Image

from megarl.config import ConfigError
from megarl.config.tiny import tiny_config
from megarl.data.dataset import load_prompt_file
from megarl.data.files import InputError
from megarl.data.images import ImagePrompts, image_examples, loss_mask_without_images
from megarl.data.inputs import image_prompts
from megarl.models.tiny_vl import build_tiny_vl_model, build_tiny_vl_tokenizer


def _png(width, height, colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _prompts(tmp_path, rows) -> list:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_prompt_file(path)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model_dir = build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")
    tokenizer = build_tiny_vl_tokenizer()
    return model_dir, tokenizer, ImagePrompts(model_dir, tokenizer)


def test_rows_with_images_become_expanded_ids_and_pixel_values(tmp_path, vl):
    model_dir, tokenizer, prompts = vl
    (tmp_path / "a.png").write_bytes(_png(20, 12, "red"))
    data_url = "data:image/png;base64," + base64.b64encode(_png(8, 8, "blue")).decode()
    rows = [{"prompt": [{"role": "user", "content": "<image>how many red squares?"}], "images": ["a.png"], "answer": "1"},
            {"prompt": "compare", "images": [{"path": "a.png"}, data_url], "answer": "no"},
            {"prompt": "no image here", "answer": "x"}]
    examples = image_examples(_prompts(tmp_path, rows), tokenizer, prompts, tmp_path, chat_template=False)
    pad, start, end = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    first = examples[0]
    assert first["prompt"] == "user: <|vision_start|><|image_pad|><|vision_end|>how many red squares?\nassistant: "
    assert first["image_grid_thw"].tolist() == [[1, 6, 10]]  # 12x20 pixels in 2x2 patches
    ids = first["prompt_ids"]
    assert ids.count(pad) == 15 and ids[ids.index(pad) - 1] == start and ids[ids.index(pad) + 15] == end
    expected = prompts.processor(images=[Image.open(tmp_path / "a.png").convert("RGB")], return_tensors="pt")
    assert torch.equal(first["pixel_values"], expected["pixel_values"])
    second = examples[1]  # two images without markers: both in front, in order
    assert second["image_grid_thw"].tolist() == [[1, 6, 10], [1, 4, 4]] and second["prompt_ids"].count(pad) == 15 + 4
    assert examples[2]["pixel_values"] is None and pad not in examples[2]["prompt_ids"]
    tokens = torch.tensor([second["prompt_ids"]])
    mask = loss_mask_without_images(torch.ones_like(tokens, dtype=torch.float), tokens, pad)
    assert mask.sum() == tokens.numel() - 19


def test_missing_unreadable_and_miscounted_images_are_named(tmp_path, vl):
    _, tokenizer, prompts = vl
    (tmp_path / "bad.png").write_bytes(b"not an image")
    for row, message in (({"prompt": "p", "images": ["missing.png"], "answer": "a"},
                          r"prompts.jsonl, row 1, image 0: image file .*missing.png does not exist"),
                         ({"prompt": "p", "images": ["bad.png"], "answer": "a"},
                          r"prompts.jsonl, row 1, image 0: image 'bad.png' is not a readable image"),
                         ({"prompt": "<image><image>", "images": ["bad.png"], "answer": "a"},
                          r"prompts.jsonl, row 1: the prompt has 2 <image> markers but the row 1 images")):
        with pytest.raises(InputError, match=message):
            image_examples(_prompts(tmp_path, [row]), tokenizer, prompts, tmp_path, chat_template=False)


def test_max_pixels_from_the_config_gives_the_same_image_fewer_patches(tmp_path, vl):
    model_dir, tokenizer, _ = vl
    (tmp_path / "a.png").write_bytes(_png(20, 12, "red"))
    rows = _prompts(tmp_path, [{"prompt": "<image>how many?", "images": ["a.png"], "answer": "1"}])

    def grid(*overrides):
        prompts = image_prompts(tiny_config([f"model.path={model_dir}", *overrides]), tokenizer, rows)
        return image_examples(rows, tokenizer, prompts, tmp_path, chat_template=False)[0]["image_grid_thw"].tolist()

    assert grid() == [[1, 6, 10]]  # the directory's bounds (16..1024 pixels): 12x20 pixels in 2x2 patches
    assert grid("data.max_pixels=64") == [[1, 2, 4]]  # 4x8 pixels: sides multiples of patch 2 x merge 2
    assert grid("data.min_pixels=960") == [[1, 12, 20]]
    with pytest.raises(ConfigError, match="data.min_pixels=100, data.max_pixels=50"):
        tiny_config(["data.min_pixels=100", "data.max_pixels=50"])
    with pytest.raises(InputError, match=r"data.max_pixels=8 .* >= 16 \(one merged patch"):
        grid("data.max_pixels=8")


def test_shapes_task_answers_are_the_red_squares_and_blank_images_carry_none(tmp_path, vl):
    import numpy as np

    from megarl.data.shapes import RED, write_shapes_prompts

    _, tokenizer, prompts = vl
    path = write_shapes_prompts(tmp_path / "shapes", rows=12, seed=0)
    blank = write_shapes_prompts(tmp_path / "blank", rows=12, seed=0, blank=True)
    assert path.read_text() == blank.read_text()  # same prompts and answers
    examples = image_examples(load_prompt_file(path), tokenizer, prompts, path.parent, chat_template=False)
    answers = [int(ex["answer"]) for ex in examples]
    assert len(set(answers)) > 1
    for ex, answer in zip(examples, answers):
        pixels = np.asarray(Image.open(path.parent / ex["images"][0]))
        red = (pixels == RED).all(-1)
        # a red square fills a 4x4 block of its 8x8 cell; a red plus never does
        cells = red.reshape(3, 8, 3, 8).transpose(0, 2, 1, 3)
        assert int(cells[:, :, 2:6, 2:6].all((-1, -2)).sum()) == answer
        assert ex["image_grid_thw"].tolist() == [[1, 12, 12]]  # 24x24 pixels, 2x2 patches
    assert all((np.asarray(Image.open(blank.parent / f"image_{i:05d}.png")) == 255).all() for i in range(12))


def test_colour_task_answers_are_the_colour_of_the_image_and_bad_task_is_named(tmp_path):
    import numpy as np

    from megarl.data.shapes import COLOURS, WHITE, write_shapes_prompts

    path = write_shapes_prompts(tmp_path / "colour", rows=12, seed=0, task="colour")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["answer"] for r in rows} == {"R", "G", "B"}
    for row in rows:
        pixels = np.asarray(Image.open(path.parent / row["images"][0]))
        assert (pixels[12, 12] == COLOURS[row["answer"]]).all() and (pixels[0, 0] == WHITE).all()
        assert (pixels[4:20, 4:20] == COLOURS[row["answer"]]).all()  # all but a half-cell border
    with pytest.raises(ValueError, match="shapes task 'size'"):
        write_shapes_prompts(tmp_path / "bad", rows=1, seed=0, task="size")
