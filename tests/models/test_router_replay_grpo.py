"""GRPO end to end on the CPU with actor.router_replay=rollout: a tiny random Qwen3-MoE policy, the transformers
rollout engine recording the experts of every token it generates, the trainer's routers replaying them in the
old-log-prob and training forwards (tests/models/test_router_replay.py shows the replay itself; the engine refuses a
batch without the record, so the record reaches the trainer)."""

import json
import math

from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from tests.conftest import QUICKSTART as RECIPE
from tests.models.hf_families import qwen3_moe_config, save_random_for_recipe


def test_grpo_step_with_rollout_routing_replay(tmp_path, ray_local):
    model = save_random_for_recipe(qwen3_moe_config(tied=False, norm_topk_prob=True), tmp_path / "moe", seed=5)
    cfg = tiny_config([
        f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}", "actor.router_replay=rollout",
        "actor.parallel.tp=1", "actor.micro_batch_size=4", "algorithm.recompute_old_logprobs=always",
        "data.prompts_per_step=2", "rollout.n_samples=2", "data.val_size=2", "sft.steps=0", "trainer.steps=1", "trainer.eval_every=0",
        "reward.name=reverse", "trainer.loggers=jsonl"], path=RECIPE)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (run_dir(tmp_path / "run") / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 1 and math.isfinite(steps[0]["train/loss"]) and math.isfinite(steps[0]["train/grad_norm"])
