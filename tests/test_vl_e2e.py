"""Vision-language GRPO through the real trainer on CPU (configs/quickstart_vl.yaml, shrunk): a tiny random Qwen2.5-VL,
the shapes images, a supervised warm start and one GRPO step. The hf engine's rollout log-probs equal Megatron's on
the image rows (fp32), every sample of a prompt carries its prompt's images and no image placeholder is trained on,
and the step moves the vision tower (the images reached the gradient)."""

from pathlib import Path

import torch

from megarl.config.tiny import tiny_config
from megarl.data.shapes import write_shapes_splits
from megarl.models.tiny_vl import build_tiny_vl_model, build_tiny_vl_tokenizer
from megarl.trainer import RLTrainer

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "quickstart_vl.yaml"


def first_character_parity(response: str, answer: str, sample: dict) -> float:
    """A reward that differs within a group even for a random policy, so that GRPO's step has a gradient."""
    return float(ord(response[0]) % 2) if response else 0.0


# the agent loop with a tool that answers with an image (benchmarks/vl_grpo.py: the GPU check's tool), two turns
AGENT_SHOWING_SQUARES = ["agent.enabled=true", "agent.tools=[benchmarks.vl_grpo:ShowSquare]",
                         "agent.parser=benchmarks.vl_grpo:show_square_every_turn", "agent.max_turns=2",
                         "agent.max_new_tokens_per_turn=3", "agent.max_response_tokens=64"]


def tiny_vl_config(tmp_path, val_rows: int, overrides: list[str]):
    """The recipe on a tiny random Qwen2.5-VL and 8 training rows of shapes images, 2 samples of 3 tokens per
    prompt, rewarded by first_character_parity; `overrides` after those."""
    splits = write_shapes_splits(tmp_path / "shapes", train_rows=8, val_rows=val_rows)
    return tiny_config([
        f"model.path={build_tiny_vl_model(tmp_path / 'model')}", f"data.task={splits['train']}",
        f"data.val_task={splits['val']}", f"sft.data={splits['train']}", "rollout.n_samples=2",
        "rollout.max_new_tokens=3", "trainer.eval_every=0", "trainer.loggers=[jsonl]", f"trainer.output_dir={tmp_path}",
        f"reward.name={__name__}:first_character_parity", "reward.isolation=none", *overrides], path=RECIPE)


def test_one_grpo_step_with_images(tmp_path, ray_local):
    cfg = tiny_vl_config(tmp_path, 4, ["sft.steps=1", "sft.batch_size=4", "data.prompts_per_step=4",
                                       "data.val_size=4", "trainer.steps=1", f"rollout.dump_dir={tmp_path / 'dumps'}"])
    trainer = RLTrainer(cfg)
    try:
        trainer.prepare()
        before = trainer.actor.call("hf_state_dict")[0]
        metrics = trainer.step()
        after = trainer.actor.call("hf_state_dict")[0]
    finally:
        trainer.shutdown()
    assert metrics["rollout/logprob_abs_diff"] < 1e-5  # the same tokens, images and M-RoPE positions on both sides
    assert metrics["train/grad_norm"] > 0
    tower = [n for n in after if n.startswith("visual.")]
    assert tower and any(not torch.equal(after[n], before[n]) for n in tower)

    dump = torch.load(next((tmp_path / "dumps").glob("*.pt")), weights_only=False)
    rows, fields = dump["tensors"], dump["non_tensors"]
    groups, pixels, grids = fields["group"], fields["pixel_values"], fields["image_grid_thw"]
    assert len(groups) == 8 and all(p is not None for p in pixels)
    for i in range(len(groups)):  # a group's samples share their prompt's images; other prompts have other images
        for j in range(len(groups)):
            assert torch.equal(pixels[i], pixels[j]) == (groups[i] == groups[j]), (i, j)
    image_pad = build_tiny_vl_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    placeholders = rows["tokens"] == image_pad
    expected = torch.tensor([int(g.prod(-1).sum()) // 4 for g in grids])  # t*h*w / merge^2 per image
    assert torch.equal(placeholders.sum(1), expected)  # all in the prompt, none sampled
    assert (rows["loss_mask"][placeholders] == 0).all() and (rows["loss_mask"].sum(1) > 0).all()


def test_agent_loop_with_images_from_a_tool(tmp_path, ray_local):
    """A tool answers with an image: the observation holds its placeholders after the text (never trained on), the row's
    images grow by it (prompt's first), the next turn is generated seeing it, and the hf engine's log-probs equal
    Megatron's on the whole rows (both sides place the tool's image in the M-RoPE positions and the vision tower)."""
    cfg = tiny_vl_config(tmp_path, 2, ["sft.steps=0", "data.prompts_per_step=2", "data.val_size=2", "trainer.steps=1",
                                       *AGENT_SHOWING_SQUARES, f"rollout.dump_dir={tmp_path / 'dumps'}"])
    trainer = RLTrainer(cfg)
    try:
        trainer.prepare()
        metrics = trainer.step()
    finally:
        trainer.shutdown()
    assert metrics["rollout/logprob_abs_diff"] < 1e-5
    dump = torch.load(next((tmp_path / "dumps").glob("*.pt")), weights_only=False)
    fields, rows = dump["non_tensors"], dump["tensors"]
    image_pad = build_tiny_vl_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    for i, t in enumerate(fields["trajectory"]):
        assert [turn["role"] for turn in t["turns"]] == ["assistant", "tool", "assistant"]
        assert t["turns"][1]["calls"][0]["images"] == 1 and t["turns"][1]["calls"][0]["result"] == "a square:"
        grids = fields["image_grid_thw"][i]
        assert grids[-1].tolist() == [1, 8, 8] and len(grids) >= 2  # the prompt's images, then the tool's
        placeholders = rows["tokens"][i] == image_pad
        assert placeholders.sum() == int(grids.prod(-1).sum()) // 4 and rows["loss_mask"][i][placeholders].sum() == 0
        start = int(rows["attention_mask"][i].sum()) - t["turns"][-1]["span"][1]
        observation = t["turns"][1]["span"]
        assert placeholders[start + observation[0]:start + observation[1]].sum() == 16
        assert fields["pixel_values"][i].shape[0] == int(grids.prod(-1).sum())
