"""A short GRPO run of a LoRA policy (actor.lora) through the real trainer, each sync merged (checksum-verified) or the
adapter alone (rollout.lora_sync=adapter, the hf engine merging it): either way the rollout engine holds the weights
the trainer exports merged, the base stays bitwise the checkpoint's, only the adapters have gradients, and the
adapters are written as a PEFT directory at the end (actor.lora.peft_dir)."""

import json

import pytest
import ray
import torch
from safetensors.torch import load_file

from megarl.config.tiny import tiny_config
from megarl.rewards import REWARDS
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from megarl.workers import sync_checks
from tests.conftest import QUICKSTART


@REWARDS.register("test_lora_response_sum")
def response_sum(response: str, answer: str, sample: dict) -> float:
    """Differs between a group's responses: every step has advantages, so the adapters move."""
    return float(sum(map(ord, response)) % 97)


def _base_and_trainable(worker):
    """In the training rank: the names of the HF tensors whose exported base (adapters not merged) differs from the
    model directory's, and the megatron parameters that need gradients."""
    from safetensors.torch import load_file

    from megarl.engine import weights

    e = worker.engine
    base = {n: t for bucket in weights.export_hf_weights(e.gpts, e.weight_maps, e.layout, e.hf_tensors, e.device,
                                                         1 << 30) for n, t in bucket}
    original = load_file(f"{e.model_path}/model.safetensors")
    changed = [n for n, t in original.items() if not torch.equal(base[n], t)]
    trainable = [n for n, p in weights.global_parameters(e.gpts).items() if p.requires_grad]
    return changed, trainable, original


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_grpo_with_lora_syncs_the_policy_and_trains_only_the_adapters(tmp_path, ray_local, sync):
    cfg = tiny_config([
        f"trainer.output_dir={tmp_path}", "data.prompts_per_step=2",
        "rollout.n_samples=2", "data.val_size=2", "sft.steps=0", "trainer.steps=2", "trainer.eval_every=2",
        "reward.name=test_lora_response_sum", "reward.isolation=none", "trainer.loggers=jsonl",
        "trainer.verify_weight_sync_every=1", "actor.optim.lr=1e-2", f"rollout.lora_sync={sync}",
        f"actor.lora.peft_dir={tmp_path / 'peft'}",
        "actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=q_proj,v_proj,down_proj"],
        path=QUICKSTART)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        trainer.colocation.to_training()
        merged = trainer.actor.call("hf_state_dict")[0]
        # the export is collective: every rank runs it
        changed, trainable, original = ray.get([w.__ray_call__.remote(_base_and_trainable)
                                                for w in trainer.actor.workers])[0]
        trainer.publish_policy()
        held = ray.get(trainer.rollout.weight_digests.remote({n: t.dtype for n, t in merged.items()}))
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2 and all(r["sync/verified"] == float(sync == "merged") for r in steps)
    peft = load_file(f"{tmp_path}/peft/adapter_model.safetensors")  # actor.lora.peft_dir, at the end of the run
    assert len(peft) == 2 * 3 * 2  # 2 layers x 3 projections x (A, B)
    adapter_bytes = sum(t.numel() * t.element_size() for t in peft.values())
    assert all(r["sync/bytes"] == adapter_bytes if sync == "adapter" else r["sync/bytes"] > 10 * adapter_bytes
               for r in steps)
    if sync == "adapter":  # the latest policy's directory alone is kept, and it is the end of the run's
        latest = sorted((tmp_path / "lora_sync").iterdir())
        synced = load_file(f"{latest[0]}/adapter_model.safetensors")
        assert len(latest) == 1 and synced.keys() == peft.keys() and all(torch.equal(synced[k], peft[k]) for k in peft)
    assert held == {n: sync_checks.tensor_digest(t) for n, t in merged.items()}  # the rollout engine holds the merge
    assert changed == []  # the base bitwise as loaded
    assert trainable and all(".lora.adapters." in n for n in trainable)
    assert {n.split(".lora.adapters.")[1] for n in trainable} == {"q_proj.A", "q_proj.B", "v_proj.A", "v_proj.B",
                                                                 "down_proj.A", "down_proj.B"}
    moved = {n for n, t in original.items() if not torch.equal(merged[n], t)}
    assert moved and {n.rsplit(".", 2)[-2] for n in moved} == {"q_proj", "v_proj", "down_proj"}
