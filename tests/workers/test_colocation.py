"""The colocated cycle on CPU, and the weight sync through the resharder at training TP=2.

Run A: no offload, whole HF tensors per bucket. Run B: the colocated cycle (training engines offloaded
during rollouts, the hf engine releasing its weights during training) and sharded delivery at generation
TP=2 (each training rank sends its own rows). Both must train bitwise alike; in B memory must really
leave each engine during the other's phase, and the rollout engine must hold exactly the exported policy.
"""

import json

import ray
import torch

from megarl.config.tiny import tiny_config
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from megarl.workers import sync_checks

from tests.conftest import QUICKSTART as RECIPE


def _run(out, *overrides) -> dict:
    cfg = tiny_config([
        f"trainer.output_dir={out}", "actor.parallel.world_size=2", "actor.parallel.tp=2", "data.prompts_per_step=4",
        "rollout.n_samples=4", "data.val_size=4", "sft.steps=2", "trainer.steps=2", "trainer.eval_every=2",
        "reward.name=reverse", "trainer.loggers=jsonl", *overrides], path=RECIPE)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
        result = {"phase": trainer.colocation.phase}
        # in the rollout phase: what each engine holds, and the rollout engine's weights
        result["rollout_phase"] = ([m["resident"] for m in trainer.actor.call("memory")],
                                   ray.get(trainer.rollout.resident_bytes.remote()))
        trainer.colocation.to_training()
        result["training_phase"] = ([m["resident"] for m in trainer.actor.call("memory")],
                                    ray.get(trainer.rollout.resident_bytes.remote()))
        result["state"] = trainer.actor.call("hf_state_dict")[0]
        trainer.publish_policy()  # back to the rollout phase: refilled, verified
        result["held"] = ray.get(trainer.rollout.weight_digests.remote({n: t.dtype for n, t in result["state"].items()}))
    finally:
        trainer.shutdown()
    result["rows"] = [json.loads(line) for line in (run_dir(out) / "metrics.jsonl").read_text().splitlines()]
    return result


def test_offload_cycle_and_sharded_sync_match_the_plain_run_bitwise(tmp_path, ray_local):
    a = _run(tmp_path / "a", "trainer.offload_between_phases=never")
    b = _run(tmp_path / "b", "trainer.offload_between_phases=always", "rollout.weight_delivery=sharded",
             "rollout.sglang_tp=2")

    # the same run: every loss, reward and log-prob gap, and the final weights, bit for bit
    def learning(rows):
        return [{k: v for k, v in r.items() if k.split("/")[0] in ("train", "val", "sft", "rollout")} for r in rows]
    assert learning(a["rows"]) == learning(b["rows"])
    assert any("train/loss" in r for r in a["rows"]) and any("sft/loss" in r for r in a["rows"])
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][n], b["state"][n]) for n in a["state"])
    # what A's sync moved: the whole policy once; B's ranks sent their rows (norms by both)
    full = sum(t.numel() * t.element_size() for t in a["state"].values())
    syncs_a = [r["sync/bytes"] for r in a["rows"] if "sync/bytes" in r]
    syncs_b = [r["sync/bytes"] for r in b["rows"] if "sync/bytes" in r]
    assert syncs_a == [full] * 2 and all(full < s < 1.1 * full for s in syncs_b)

    # both rollout engines hold exactly the exported policy (B's assembled from two ranks' shards)
    for run in (a, b):
        assert run["held"] == {n: sync_checks.tensor_digest(t) for n, t in run["state"].items()}

    # A never moves memory; B's engines give it up in the other's phase and get every byte back
    assert a["phase"] == "training" and "memory/offloaded_gb" not in str(a["rows"])
    assert b["phase"] == "rollout"
    (train_rollout, engine_rollout), (train_training, engine_training) = b["rollout_phase"], b["training_phase"]
    assert train_rollout == [0, 0] and engine_rollout > 0
    assert min(train_training) > 0 and engine_training == 0
    step = next(r for r in b["rows"] if "memory/offloaded_gb" in r)
    assert step["memory/trained/train_resident_gb"] > 0 and step["memory/offloaded/train_resident_gb"] == 0
    assert step["memory/onloaded/train_resident_gb"] == step["memory/trained/train_resident_gb"]
    assert step["memory/released/rollout_resident_gb"] == 0 and step["memory/kv_cache/rollout_resident_gb"] > 0
    assert step["memory/offloaded_gb"] >= 2 * step["memory/trained/train_resident_gb"] * 0.9  # two ranks
