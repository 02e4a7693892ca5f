import torch

from megarl.algorithms.dapo import take_groups
from megarl.protocol import Batch


def round_of(groups, rewards):
    return Batch({"rewards": torch.tensor(rewards)}, {"group": groups, "response": [f"{g}{i}" for i, g in
                                                                                    enumerate(groups)]})


def test_varied_groups_first_in_generation_order_then_filler():
    first = round_of([0, 0, 1, 1, 2, 2], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # group 0 varied; 1, 2 all equal
    second = round_of([3, 3, 4, 4, 5, 5], [0.0, 0.0, 0.5, 1.0, 1.0, 0.0])  # 4 and 5 varied
    batch, filler = take_groups([first, second], 3)
    assert batch["group"] == [0, 0, 4, 4, 5, 5] and filler == 0
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.5, 1.0, 1.0, 0.0]
    batch, filler = take_groups([first, second], 4)  # only 3 varied groups: the first all-equal one fills
    assert batch["group"] == [0, 0, 1, 1, 4, 4, 5, 5] and filler == 1
    batch, filler = take_groups([first], 2)
    assert batch["group"] == [0, 0, 1, 1] and filler == 1
