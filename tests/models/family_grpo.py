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


def assert_text_only_grpo_keeps_the_tower(make_config, model_dir, run_root, tower, overrides: list[str], seed: int):
    """A multimodal checkpoint (`make_config(**text_fields)`, saved at `model_dir` with a character tokenizer) trained as a text-only
    policy for two GRPO steps: every sync verified, every language weight moved and held by the rollout engine, none
    of the tower's (names starting with `tower`) sent, and the step's checkpoint keeping the tower bitwise."""
    import torch
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    from megarl.models.tiny import build_char_tokenizer
    from megarl.workers import sync_checks
    from tests.models.hf_families import save_random

    tokenizer = build_char_tokenizer()
    config = make_config(vocab_size=128, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = save_random(config, model_dir, seed=seed)
    tokenizer.save_pretrained(model)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True).save_pretrained(model)
    state, held, steps = grpo_then_weights(model, run_root, [
        "actor.micro_batch_size=4", "trainer.save_every=2",
        # a random policy earns no reward, so no advantage: the entropy bonus still moves every weight
        "algorithm.entropy_coef=0.01", *overrides])

    assert held == {n: sync_checks.tensor_digest(t) for n, t in state.items()}
    initial = load_file(f"{model}/model.safetensors")
    assert sorted(state) == sorted(n for n in initial if not n.startswith(tower))
    assert all(not torch.equal(state[n], initial[n]) for n in state)
    assert len(steps) == 2 and all(r["sync/verified"] == 1.0 and r["train/grad_norm"] > 0 for r in steps)
    kept = load_file(run_root / "checkpoints" / "step_00000002" / "actor" / "hf" / "vision.safetensors")
    assert kept.keys() == {n for n in initial if n.startswith(tower)}
    assert all(torch.equal(kept[n], initial[n]) for n in kept)
