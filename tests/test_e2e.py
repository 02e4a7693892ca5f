"""The whole system on CPU: Ray actors, megatron-core at TP=2 over gloo, the transformers rollout engine."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch

from megarl.config.tiny import tiny_config
from megarl.reshard.inventory import hf_inventory
from megarl.rollout.weight_layout import ExpectedChecksums, layout_for
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir
from megarl.workers import sync_checks, weight_sync

from tests.conftest import QUICKSTART as RECIPE


def tiny_grpo(tmp_path, *overrides):
    return tiny_config([
        f"trainer.output_dir={tmp_path}", "actor.parallel.world_size=2", "actor.parallel.tp=2",
        "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=16", "sft.steps=10",
        "reward.name=reverse",  # partial credit: rewards differ within groups even for a weak policy
        "trainer.loggers=jsonl", *overrides], path=RECIPE)


def test_grpo_steps_change_weights_and_sync_them_exactly(tmp_path, ray_local):
    trainer = RLTrainer(tiny_grpo(tmp_path, "trainer.verify_weight_sync_every=2", "trainer.profile_update=2"))
    try:
        trainer.prepare()
        before = trainer.actor.call("hf_state_dict")[0]
        for step in range(1, 4):
            metrics = trainer.step()
            # syncs 0 (the warm start's) and 2 are verified by the trainer; this test checks every one itself
            assert metrics["sync/verified"] == float(step % 2 == 0) and metrics["sync/direct"] == 0.0
            # a verified sync's rollout engine checksums are compared in the next step, before its update
            assert ("sync/verify_deferred_s" in metrics) == (step % 2 == 1)
            after = trainer.actor.call("hf_state_dict")[0]
            # the policy moved ...
            assert max((after[n] - before[n]).abs().max().item() for n in after) > 0
            # ... on a batch whose rewards differ within groups (otherwise GRPO has nothing to learn from)
            assert metrics["train/grad_norm"] > 0
            # ... and the rollout engine now holds exactly the trained weights
            held = ray.get(trainer.rollout.weight_digests.remote({n: t.dtype for n, t in after.items()}))
            assert held == {n: sync_checks.tensor_digest(t) for n, t in after.items()}
            before = after
        assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in after.values())
        # trainer.profile_update=2: the second policy update, and only it, profiled on both ranks
        assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["update_2_rank_0", "update_2_rank_1"]
        for rank in (0, 1):
            files = tmp_path / "profile" / f"update_2_rank_{rank}"
            assert sorted(f.name for f in files.iterdir()) == ["ops_by_device.txt", "ops_by_host.txt", "trace.json.gz"]
            assert "aten::mm" in (files / "ops_by_host.txt").read_text()  # the update's own matrix multiplies

        # A transport that flips one element of one tensor on the way must not go unnoticed: by the default check
        # (the engine's checksums of what it holds against the sender's, compared in the step after the sync, once
        # its rollouts are generated and before anything trains on them) and by the deep one (digests).
        layout = layout_for(hf_inventory(json.loads((Path(trainer.model_path) / "config.json").read_text())), "hf")
        expected = ExpectedChecksums(layout, [0])
        for n, t in after.items():
            expected.add(n, t)
        trainer.unchecked = expected.result()  # as a verified sync of `after` leaves it
        assert trainer.check_rollout_weights().keys() == {"sync/verify_deferred_s"} and trainer.unchecked is None
        sent = {n: (t.dtype, sync_checks.tensor_digest(t)) for n, t in after.items()}
        name = sorted(after)[1]
        corrupted = after[name].clone()
        corrupted.view(-1)[3] += 1.0
        ray.get(trainer.rollout.update_weights.remote([(name, corrupted)]))
        trainer.unchecked, version = expected.result(), trainer.version
        with pytest.raises(weight_sync.WeightSyncError, match=rf"1 differ \['server 0 rank 0: {name}'\]"):
            trainer.step()  # generates from the corrupt weights, then stops before the update
        assert trainer.version == version
        assert all(torch.equal(t, after[n]) for n, t in trainer.actor.call("hf_state_dict")[0].items())
        with pytest.raises(weight_sync.WeightSyncError, match=rf"1 tensor\(s\) differ \['{name}'\]"):
            trainer.verify_rollout_weights([SimpleNamespace(sent=sent)])  # the deep check reads `sent` alone
    finally:
        trainer.shutdown()


def test_rl_beats_the_learning_rate_zero_control(tmp_path, ray_local):
    """A seeded short quickstart: the held-out gain comes from RL, not from the warm start. The control (lr=0) keeps
    its weights, so its held-out reward stays exactly where it started after any number of its steps: it resumes the
    RL run's last checkpoint with lr=0 and 4 steps show it (the evaluation, seeded, is the same after them), so the
    RL run's gain over its own warm start is the gain of its updates.

    The held-out reward is mean@8 over 256 prompts (2048 samples, the same draws in both runs): its binomial std is
    <= 0.011, <= 0.016 for a difference of two (the quickstart's 64 x 4: ~0.03, as large as a short run's gain).
    Processors' kernels move the warm start and the trajectory (seed 1's warm start on the quickstart's evaluation:
    0.32-0.38 over machines), as trainer.seed's data order and draws do. Gains after 60 steps from seed 1's tiny
    model, trainer.seed 1-10: 0.104 0.124 0.228 0.155 0.195 0.132 0.117 0.117 0.116 0.185 (after 40: 0.094-0.184).
    The threshold, 0.05, is under half the smallest and 3 std of the evaluation; with the policy loss's sign flipped
    the gain is -0.29, with lr=1e-6 +0.009. The seed is pinned because trainer.seed also draws the tiny model's
    initial weights, and other ones learn at other rates (seed 3's warm start is 0.94: no room; seed 4's gains
    0.044 in 60 steps)."""
    val, steps, control_steps = {}, 60, 4
    rl = tmp_path / "rl"
    checkpoint = rl / "checkpoints" / f"step_{steps:08d}"
    # the control resumes the RL run's checkpoint (no second warm start): lr=0 and the later steps the only changes
    for lr, out, overrides in ((5e-4, rl, [f"trainer.steps={steps}", f"trainer.save_every={steps}"]),
                               (0.0, tmp_path / "control", [f"trainer.steps={steps + control_steps}",
                                                            f"trainer.resume={checkpoint}"])):
        cfg = tiny_config([f"trainer.output_dir={out}", f"actor.optim.lr={lr}", f"trainer.eval_every={steps}",
                           "trainer.seed=1", "data.val_size=256", "rollout.eval_n_samples=8", "trainer.loggers=jsonl",
                           *overrides], path=RECIPE)
        trainer = RLTrainer(cfg)
        try:
            val[lr] = dict(trainer.fit()["val/reward"])
        finally:
            trainer.shutdown()
        rows = [json.loads(line) for line in (run_dir(out) / "metrics.jsonl").read_text().splitlines()]
        assert any("train/kl" in r for r in rows)
        assert {r["train/lr"] for r in rows if "train/lr" in r} == {lr}, out  # the control trains at lr=0
    assert sorted(val[5e-4]) == [0, steps], val
    # the control's history is the RL run's up to its checkpoint, then its own: the reward it resumed with, unmoved
    assert val[0.0] == val[5e-4] | {steps + control_steps: val[5e-4][steps]}, val
    assert val[5e-4][steps] > val[5e-4][0] + 0.05, val


def test_the_driver_runs_on_one_torch_thread_and_gives_the_pool_back(tmp_path):
    """run_trainer: the driver's small tensor ops on one thread during the run (a pool over every core waited
    40 ms a step on a busy GPU host), the caller's pool size after it, a failed run included."""
    from megarl.train import run_trainer

    seen, before = [], max(torch.get_num_threads(), 2)
    torch.set_num_threads(before)

    class Trainer:
        def __init__(self, cfg):
            pass

        def fit(self):
            seen.append(torch.get_num_threads())
            raise RuntimeError("a step failed")

        def shutdown(self):
            pass

    class Ray:
        def shutdown(self):
            pass

    cfg = tiny_config([f"trainer.output_dir={tmp_path}"], path=RECIPE)
    with pytest.raises(RuntimeError, match="a step failed"):
        run_trainer(cfg, Ray(), Trainer)
    assert seen == [1] and torch.get_num_threads() == before


def test_the_driver_starts_without_megatron():
    """The driver's modules (the RL and reward-model trainers, resume and stops, the checkpoint directory) leave
    megatron-core to the ranks: importing it took the driver ~6 s of every start."""
    probe = ("import sys, megarl.train, megarl.trainer, megarl.rm_trainer, megarl.resume, megarl.stops; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["[]"], done.stdout + done.stderr
