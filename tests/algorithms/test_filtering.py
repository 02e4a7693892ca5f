"""PF-PPO (megarl/algorithms/filtering.py): verl's weight modes by hand, the resampled batch, the re-weighted
advantages, the replay of high-reward samples and its checkpoint state."""

import pytest
import torch

from megarl.algorithms.filtering import MIN_WEIGHT, PolicyFilter, pf_ppo_weights
from megarl.config.knob_sections import PFPPOConfig
from megarl.protocol import Batch

# two prompts of three responses; the batch's highest reward 1.0 (row 1), lowest -0.5 (row 2);
# group 1's highest 0.9 (row 4), lowest 0.0 (row 5)
REWARDS = [0.2, 1.0, -0.5, 0.7, 0.9, 0.0]
GROUP = [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("mode, scope, expected", [
    ("pow", "batch", [0.04, 1.0, 0.25, 0.49, 0.81, 0.0]),           # |r| ** 2
    ("max_min", "batch", [0, 1, 1, 0, 0, 0]),
    ("max_min", "group", [0, 1, 1, 0, 1, 1]),
    ("max_random", "batch", [0.1, 0.4, 0.1, 0.1, 0.1, 0.1]),
    ("max_random", "group", [0.1, 0.4, 0.1, 0.1, 0.4, 0.1]),
])
def test_weights_by_hand(mode, scope, expected):
    assert pf_ppo_weights(torch.tensor(REWARDS), GROUP, mode, 2.0, scope).tolist() == pytest.approx(expected)


def batch(rewards, group):
    n = len(rewards)
    return Batch({"rewards": torch.tensor(rewards), "advantages": torch.arange(n, dtype=torch.float32)[:, None]
                  .expand(n, 3).contiguous(), "loss_mask": torch.ones(n, 3)}, {"group": list(group)})


def test_resampling_draws_only_the_weighted_rows():
    f = PolicyFilter(PFPPOConfig(method="max_min"), seed=0)
    out, metrics = f(batch(REWARDS, GROUP))
    assert len(out) == 6 and set(out["rewards"].tolist()) <= {1.0, -0.5}
    # rows keep their own fields together: the advantage identifies the row
    assert all(REWARDS[int(a)] == r for a, r in zip(out["advantages"][:, 0].tolist(), out["rewards"].tolist()))
    assert metrics["pf_ppo/distinct_rows"] <= 2 / 6 and metrics["pf_ppo/replayed_rows"] == 0


def test_weighting_scales_the_advantages_by_weight_over_mean():
    f = PolicyFilter(PFPPOConfig(method="pow", resample=False), seed=0)
    out, _ = f(batch(REWARDS, GROUP))
    weights = [r * r + MIN_WEIGHT for r in REWARDS]
    mean = sum(weights) / 6
    assert out["advantages"][:, 0].tolist() == pytest.approx([i * w / mean for i, w in enumerate(weights)])


def test_replay_keeps_the_best_samples_for_later_steps_and_checkpoints():
    cfg = PFPPOConfig(method="pow", replay=2)
    f = PolicyFilter(cfg, seed=0)
    f(batch([0.0, 1.0, 0.5, 0.2], [0, 0, 1, 1]))
    assert f.replay["rewards"].tolist() == [1.0, 0.5]
    assert f.replay["group"] == [("replay", 1, 0), ("replay", 1, 1)]
    state = f.state_dict()
    # step 2's own rewards are all 0 (weight 1e-8): every draw comes from the replay
    out, metrics = f(batch([0.0] * 4, [0, 0, 1, 1]))
    assert metrics["pf_ppo/replayed_rows"] == 1.0 and set(out["rewards"].tolist()) <= {1.0, 0.5}
    # a filter restored from the checkpoint state draws the same rows
    restored = PolicyFilter(cfg, seed=123)
    restored.load_state_dict(state)
    again, _ = restored(batch([0.0] * 4, [0, 0, 1, 1]))
    assert torch.equal(again["advantages"], out["advantages"]) and again["group"] == out["group"]
