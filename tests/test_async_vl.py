"""A vision-language policy in trainer.mode=async (the hf engine, a tiny random Qwen2.5-VL, the shapes images): the
rollout actor streams each group with its prompt's images, the images reach the rows the trainer trains on, and the
rollout engine's log-probs equal Megatron's on them; a group over the staleness bound sent back for regeneration
keeps its images."""

import torch

from megarl.async_trainer import build_trainer
from megarl.protocol import IMAGE_INPUTS
from megarl.rollout_buffer import prompt_record, split_groups

from tests.test_vl_e2e import AGENT_SHOWING_SQUARES, tiny_vl_config


def test_async_groups_stream_with_their_images(tmp_path, ray_local):
    cfg = tiny_vl_config(tmp_path, 2, [
        "sft.steps=0", "data.prompts_per_step=2", "data.val_size=2", "rollout.eval_n_samples=1", "trainer.steps=2",
        "trainer.mode=async", "async.max_staleness=1",
        "actor.optim.lr=0"])  # lr 0: a batch one version old has the same log-probs
    trainer = build_trainer(cfg)
    prompts = {}  # prompt image -> its record, as the data loader gave it
    trained, metrics = [], []
    draw, train_step = trainer.data.next_batch, trainer.train_step

    def drawn(*args):
        batch = draw(*args)
        prompts.update({p["pixel_values"].sum().item(): p for p in batch})
        return batch

    def recorded(batch, *args):
        trained.append(batch)
        metrics.append(train_step(batch, *args))
        return metrics[-1]

    trainer.data.next_batch, trainer.train_step = drawn, recorded
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert len(trained) == 2 and len(prompts) == 4
    for batch, step in zip(trained, metrics):
        assert step["rollout/logprob_abs_diff"] < 1e-5  # the engine saw the images Megatron sees
        for group in split_groups(batch):
            record = prompts[group["pixel_values"][0].sum().item()]
            assert all(torch.equal(p, record["pixel_values"]) and torch.equal(g, record["image_grid_thw"])
                       for p, g in zip(group["pixel_values"], group["image_grid_thw"]))
            assert group["tokens"][0, :len(record["prompt_ids"])].tolist() == record["prompt_ids"]
            again = prompt_record(group)  # async.stale=regenerate: the prompt goes back with its images
            assert again["prompt_ids"] == record["prompt_ids"]
            assert all(torch.equal(again[k], record[k]) for k in IMAGE_INPUTS)


def test_async_agent_conversations_stream_with_their_prompts_and_tools_images(tmp_path, ray_local):
    """The agent loop in trainer.mode=async with a tool that answers with an image: the streamed conversations keep
    every image (the prompt's, then the tool's) and the engine's log-probs equal Megatron's on them, batches one
    version old included (lr 0)."""
    cfg = tiny_vl_config(tmp_path, 2, [
        "sft.steps=0", "data.prompts_per_step=2", "data.val_size=2", "trainer.steps=2", "trainer.mode=async",
        "async.max_staleness=1", "actor.optim.lr=0", *AGENT_SHOWING_SQUARES])
    trainer = build_trainer(cfg)
    trained, metrics, train_step = [], [], trainer.train_step

    def recorded(batch, *args):
        trained.append(batch)
        metrics.append(train_step(batch, *args))
        return metrics[-1]

    trainer.train_step = recorded
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert len(trained) == 2 and max(m["async/staleness_max"] for m in metrics) == 1
    for batch, step in zip(trained, metrics):
        assert step["rollout/logprob_abs_diff"] < 1e-5
        for grids in batch["image_grid_thw"]:
            assert len(grids) >= 2 and grids[-1].tolist() == [1, 8, 8]  # the prompt's images, then the tool's
