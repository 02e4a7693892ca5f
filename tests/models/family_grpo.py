"""A short GRPO run on the CPU with a tiny family policy over two ranks (the transformers rollout engine generating,
the weights synced into it verified by checksums after every step), then the policy as megatron trained it and as
the rollout engine holds it."""

from __future__ import annotations

import json

from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from tests.conftest import QUICKSTART


def grpo_then_weights(model: str, run_root, overrides: list[str]) -> tuple[dict, dict, list[dict]]:
    """(the trained policy's HF state dict, the digests of the weights the engine holds after one more sync, the
    metric rows of the RL steps); `overrides` set the layout and what the family needs."""
    import ray

    cfg = tiny_config([
        f"model.path={model}", f"trainer.output_dir={run_root}", "actor.parallel.world_size=2", "actor.parallel.tp=1",
        "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2", "sft.steps=0", "trainer.steps=2",
        "trainer.eval_every=2", "reward.name=reverse", "trainer.loggers=jsonl", "trainer.verify_weight_sync_every=1",
        *overrides], path=QUICKSTART)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        trainer.colocation.to_training()
        state = trainer.actor.call("hf_state_dict")[0]
        trainer.publish_policy()
        held = ray.get(trainer.rollout.weight_digests.remote({n: t.dtype for n, t in state.items()}))
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (run_dir(run_root) / "metrics.jsonl").read_text().splitlines()]
    return state, held, [r for r in rows if "train/loss" in r]
