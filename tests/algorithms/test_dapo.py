import pytest
import torch

from megarl.algorithms import dynamic_sampling_filter, overlong_reward_shaping
from megarl.protocol import Batch


def test_dynamic_sampling_drops_groups_with_all_equal_rewards():
    # group 0: 1, 0 (kept); group 1: 1, 1 (dropped); group 2: one sample (kept); group 3: 0, 0, 0 (dropped)
    batch = Batch({"rewards": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.0, 0.0, 0.0]),
                   "loss_mask": torch.arange(8.0)[:, None].expand(8, 2)},
                  {"group": [0, 1, 0, 1, 2, 3, 3, 3], "response": list("abcdefgh")})
    kept, dropped = dynamic_sampling_filter(batch)
    assert dropped == 2
    assert kept["response"] == ["a", "c", "e"]  # rows 0, 2, 4, in their order, every field along
    assert kept["rewards"].tolist() == [1.0, 0.0, pytest.approx(0.3)]
    assert kept["loss_mask"][:, 0].tolist() == [0.0, 2.0, 4.0]


def test_dynamic_sampling_can_drop_everything():
    batch = Batch({"rewards": torch.tensor([0.5, 0.5])}, {"group": ["p", "p"]})
    kept, dropped = dynamic_sampling_filter(batch)
    assert len(kept) == 0 and dropped == 1


def test_overlong_reward_shaping_linear_ramp():
    # max_len 20, buffer 4: no penalty up to 16 tokens, then -(L - 16) / 4 * factor, -factor from 20 on
    lengths = torch.tensor([0, 10, 16, 17, 18, 20, 25])
    assert overlong_reward_shaping(lengths, 20, 4, 1.0).tolist() == [0, 0, 0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_reward_shaping(lengths, 20, 4, 0.5).tolist() == [0, 0, 0, -0.125, -0.25, -0.5, -0.5]
    # a buffer as long as the limit: the ramp starts at 0 tokens
    assert overlong_reward_shaping(torch.tensor([0, 5, 10]), 10, 10, 1.0).tolist() == [0, -0.5, -1.0]
    with pytest.raises(ValueError, match="0 < buffer_len <= max_len"):
        overlong_reward_shaping(lengths, 20, 0, 1.0)
