"""Checkpoints of the MegatronEngine on 2 gloo ranks: train, stop, resume.

A run: one SFT step, freeze the KL reference, then 4 RL steps (2 epochs each, LR warmup,
weight decay, clipping, KL to the reference), with a checkpoint after RL step 2. A resumed run
builds a fresh engine from the HF weights, loads that checkpoint and runs RL steps 3-4: at the same
layout its losses equal the uninterrupted run's bit for bit; at another layout (TP=2 -> PP=2,
DP=2 -> TP=2) they agree to float tolerance. The distributed optimizer (DP=2) trains like the
regular one.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
from megarl.engine.checkpoint_dir import CheckpointError, Checkpoints, read_checkpoint_file
from tests.dist_utils import run_distributed
from tests.engine.hf_models import make_qwen2_dir, padded_batch

ALGO = AlgorithmConfig(kl_coef=0.1)
SAVE_AFTER, STEPS = 2, 4


def actor_config(distributed_optimizer: bool) -> ActorConfig:
    optim = OptimConfig(lr=1e-2, warmup_steps=3, decay_style="linear", weight_decay=0.01, clip_grad=1.0)
    # One mini-batch (the whole batch) per update, so that every layout sees the same updates.
    return ActorConfig(micro_batch_size=2, ppo_epochs=2, optim=optim,
                       use_distributed_optimizer=distributed_optimizer)


def rl_step(engine, step: int) -> float:
    """One on-policy RL step on a batch that depends only on the step number."""
    batch = padded_batch(rows=8, seed=step)
    g = torch.Generator().manual_seed(100 + step)
    batch["advantages"] = torch.randn(batch["tokens"].shape, generator=g) * batch["loss_mask"]
    batch["old_logprobs"] = engine.compute_logprobs(batch)["logprobs"]
    batch.update(engine.compute_logprobs(batch, reference=True))
    return engine.train(dp_share(batch))["loss"]


def dp_share(batch):
    from megatron.core import parallel_state as ps

    return batch.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]


def save(engine, root: Path, step: int) -> None:
    """The driver's part (stage, commit) on rank 0, the engine's on every rank."""
    box = [str(Checkpoints(root).stage(step)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    engine.save_checkpoint(str(Path(box[0]) / "actor"))
    if dist.get_rank() == 0:
        Checkpoints(root).commit(Path(box[0]), step, {"step": step})
    dist.barrier()


def relayout(tp: int, pp: int, cp: int = 1) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1)


def run(model_dir, tp, pp, distributed_optimizer, save_to=None, resume_from=None, cp=1):
    """Losses of RL steps 1..STEPS (or SAVE_AFTER+1..STEPS when resuming) and the final LR."""
    from megarl.engine import MegatronEngine

    relayout(tp, pp, cp)
    engine = MegatronEngine(model_dir, actor_config(distributed_optimizer), ALGO, "cpu", 1, total_steps=10)
    first = 1
    if resume_from is not None:
        engine.load_checkpoint(str(Checkpoints(resume_from).latest() / "actor"))
        assert engine.version == 1 + SAVE_AFTER * 2  # 1 SFT step, then 2 epochs per RL step
        first = SAVE_AFTER + 1
    else:
        engine.train(dp_share(padded_batch(rows=8, seed=50)), loss="sft", lr=1e-2)
        engine.snapshot_reference()
    losses = []
    for step in range(first, STEPS + 1):
        losses.append(rl_step(engine, step))
        if save_to is not None and step == SAVE_AFTER:
            save(engine, save_to, step)
    return losses, engine.optimizer.param_groups[0]["lr"]


def _resume_rank(rank, model_dir, root):
    root = Path(root)
    out = {"tp2": run(model_dir, 2, 1, False, save_to=root / "tp2"),
           "tp2 resumed": run(model_dir, 2, 1, False, resume_from=root / "tp2"),
           "dp2": run(model_dir, 1, 1, False),
           "dp2 distopt": run(model_dir, 1, 1, True, save_to=root / "dp2"),
           "dp2 distopt resumed": run(model_dir, 1, 1, True, resume_from=root / "dp2"),
           "tp2 -> pp2": run(model_dir, 1, 2, False, resume_from=root / "tp2"),
           "dp2 distopt -> tp2 distopt": run(model_dir, 2, 1, True, resume_from=root / "dp2")}
    with pytest.raises(CheckpointError, match="use_distributed_optimizer=True"):
        run(model_dir, 2, 1, False, resume_from=root / "dp2")
    return out


def test_resume_continues_the_loss_curve(tmp_path):
    model_dir = make_qwen2_dir(tmp_path / "qwen2", tied=True)
    r = run_distributed(_resume_rank, 2, model_dir, str(tmp_path / "ckpt"), tp=2)
    full, tail = r["tp2"][0], slice(SAVE_AFTER, STEPS)
    assert len(set(full)) == STEPS  # the loss moves from step to step
    # Same layout: bit for bit, including the LR schedule.
    assert r["tp2 resumed"] == (full[tail], r["tp2"][1])
    assert r["dp2 distopt resumed"] == (r["dp2 distopt"][0][tail], r["dp2 distopt"][1])
    # The distributed optimizer trains like the regular one.
    torch.testing.assert_close(r["dp2 distopt"][0], r["dp2"][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(r["dp2"][0], full, rtol=0, atol=1e-5)
    # Another layout: the same curve to float tolerance.
    torch.testing.assert_close(r["tp2 -> pp2"][0], full[tail], rtol=0, atol=1e-5)
    torch.testing.assert_close(r["dp2 distopt -> tp2 distopt"][0], r["dp2 distopt"][0][tail], rtol=0, atol=1e-5)

    root = tmp_path / "ckpt" / "tp2"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert read_checkpoint_file(root / "step_00000002")["roles"] == ["actor"]
    assert sorted(p.name for p in (root / "step_00000002" / "actor").iterdir()) == [
        "engine.json", "hf", "reference", "state"]
