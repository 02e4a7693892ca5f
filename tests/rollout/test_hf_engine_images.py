"""The hf rollout engine with images (tiny random Qwen2.5-VL, megarl/models/tiny_vl.py): the image is seen (another
image, same ids: other log-probs), the log-probs equal transformers' own teacher-forced forward (its get_rope_index
M-RoPE positions) on prompt + response for image rows batched beside a text row, no response holds an image
placeholder, and a text-only engine refuses images by name. A tiny Qwen3-VL (tests/models/hf_qwen3_vl.py): the same
teacher-forced equality, its weights under the checkpoint's names."""

import pytest
import torch

from megarl.data.dataset import load_prompt_file
from megarl.data.images import ImagePrompts, image_examples
from megarl.data.shapes import write_shapes_prompts
from megarl.models.tiny_vl import build_tiny_vl_model, build_tiny_vl_tokenizer
from megarl.rollout.base import ImageInputs, SamplingParams
from megarl.rollout.hf import HFRolloutEngine


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The engine and three prompts: two shapes images (the same question, so the same ids) and a text-only one."""
    root = tmp_path_factory.mktemp("vl")
    model_dir = build_tiny_vl_model(root / "model")
    tokenizer = build_tiny_vl_tokenizer()
    path = write_shapes_prompts(root / "shapes", rows=2, seed=3)
    rows = load_prompt_file(path) + [{"prompt": "no image: 2+2?", "answer": "4"}]
    examples = image_examples(rows, tokenizer, ImagePrompts(model_dir, tokenizer), path.parent, chat_template=True)
    images = [ImageInputs(ex["pixel_values"], ex["image_grid_thw"]) if ex["pixel_values"] is not None else None
              for ex in examples]
    return HFRolloutEngine(str(model_dir)), [ex["prompt_ids"] for ex in examples], images


def test_the_image_changes_the_output_distribution(vl):
    engine, prompts, images = vl
    assert prompts[0] == prompts[1] and not torch.equal(images[0].pixel_values, images[1].pixel_values)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    first, second = engine.generate(prompts[:2], params, images[:2])
    swapped = engine.generate(prompts[:2], params, images[1::-1])
    assert first.logprobs[0] != pytest.approx(second.logprobs[0], abs=1e-4)
    # the images, not the rows' places in the batch, decide: swapping them swaps the outputs
    assert swapped[0].token_ids == second.token_ids and swapped[1].token_ids == first.token_ids
    assert swapped[0].logprobs == pytest.approx(second.logprobs, abs=1e-5)


def test_logprobs_equal_transformers_teacher_forced(vl):
    """An image row batched with a text row (left padding, M-RoPE decode positions): each sampled token's log-prob
    equals transformers' forward over prompt + response with its own position ids (get_rope_index)."""
    engine, prompts, images = vl
    rows, row_images = [prompts[0], prompts[2]], [images[0], images[2]]
    gens = engine.generate(rows, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1, ignore_eos=True),
                           row_images)
    placeholders = engine.image_inputs.placeholder_ids
    for prompt, image, gen in zip(rows, row_images, gens):
        assert len(gen.token_ids) == 12 and not set(gen.token_ids) & set(placeholders)
        ids = torch.tensor([prompt + gen.token_ids])
        kwargs = {} if image is None else {"pixel_values": image.pixel_values, "image_grid_thw": image.image_grid_thw}
        with torch.no_grad():
            engine.model.model.rope_deltas = None  # transformers keeps them across calls
            logits = engine.model(input_ids=ids, mm_token_type_ids=(ids == placeholders[0]).int(), **kwargs).logits
        want = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1).gather(-1, ids[0, len(prompt):, None])
        torch.testing.assert_close(torch.tensor(gen.logprobs), want[:, 0], rtol=0, atol=1e-5)


def test_text_only_engine_refuses_images(tmp_path, vl):
    from megarl.models.tiny import build_tiny_model

    _, prompts, images = vl
    engine = HFRolloutEngine(str(build_tiny_model(tmp_path / "text")))
    with pytest.raises(ValueError, match="cannot take images"):
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=2), images[:1])


def test_qwen3_vl_logprobs_equal_transformers_teacher_forced_and_weights_by_checkpoint_name(tmp_path):
    """Qwen3-VL (DeepStack, interleaved M-RoPE) in the hf engine: an image row beside a text row, each sampled
    token's log-prob equals transformers' own forward over prompt + response; the engine's weights are the
    checkpoint's names (model.language_model.*, model.visual.*), which megarl's updates are sent under."""
    from safetensors.torch import load_file

    from megarl.rollout.hf import checkpoint_views
    from tests.models.hf_qwen2_vl import IMAGE, image_rows
    from tests.models.hf_qwen3_vl import save_random_qwen3_vl

    model_dir = save_random_qwen3_vl(tmp_path / "vl")
    engine = HFRolloutEngine(model_dir)
    assert sorted(checkpoint_views(engine.model)) == sorted(load_file(f"{model_dir}/model.safetensors"))
    rows = [image_rows()[0], image_rows()[2]]
    images = [ImageInputs(r["pixel_values"], r["image_grid_thw"]) if r["pixel_values"] is not None else None
              for r in rows]
    prompts = [r["ids"][:-2] for r in rows]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, ignore_eos=True), images)
    for prompt, image, gen in zip(prompts, images, gens):
        ids = torch.tensor([prompt + gen.token_ids])
        kwargs = {} if image is None else {"pixel_values": image.pixel_values, "image_grid_thw": image.image_grid_thw}
        with torch.no_grad():
            engine.model.model.rope_deltas = None  # transformers keeps them across calls
            logits = engine.model(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), **kwargs).logits
        want = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1).gather(-1, ids[0, len(prompt):, None])
        assert len(gen.token_ids) == 6 and IMAGE not in gen.token_ids
        torch.testing.assert_close(torch.tensor(gen.logprobs), want[:, 0], rtol=0, atol=1e-5)
