import pytest
import torch

from megarl.protocol import Batch


def make(n, width=3):
    return Batch({"tokens": torch.arange(n * width).view(n, width), "rewards": torch.arange(n, dtype=torch.float)},
                 {"group": list(range(n))})


def test_chunk_and_concat_round_trip():
    b = make(6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["group"] == [2, 3]
    back = Batch.concat(parts)
    assert torch.equal(back["tokens"], b["tokens"]) and back["group"] == b["group"]
    with pytest.raises(ValueError, match="cannot split a batch of 6 into 4"):
        b.chunk(4)


def test_concat_pads_sequences_of_different_length():
    a, c = make(1, width=2), make(2, width=4)
    out = Batch.concat([a, c])
    assert out["tokens"].shape == (3, 4)
    assert out["tokens"][0].tolist() == [0, 1, 0, 0]


def test_fields_must_line_up():
    with pytest.raises(ValueError, match="differ in length"):
        Batch({"a": torch.zeros(2)}, {"b": [1, 2, 3]})
    b = make(2)
    with pytest.raises(ValueError, match="has 3 rows, the batch has 2"):
        b["x"] = torch.zeros(3)
    with pytest.raises(KeyError, match="no field"):
        b.select(["nope"])


def test_index_select_update():
    b = make(4)
    sub = b.index([3, 1])
    assert sub["group"] == [3, 1] and sub["rewards"].tolist() == [3.0, 1.0]
    sel = b.select(["rewards"])
    assert sel.keys() == ["rewards"]
    b.update(Batch({"adv": torch.ones(4)}))
    assert "adv" in b and len(b) == 4


def test_model_inputs_keep_tensors_and_images_and_leave_the_texts():
    batch = Batch({"tokens": torch.ones(2, 3, dtype=torch.long)},
                  {"group": [0, 0], "response": ["a", "b"], "pixel_values": [torch.ones(4, 2), None],
                   "image_grid_thw": [torch.ones(1, 3), None]}, {"step": 1})
    sent = batch.model_inputs()
    assert sent.keys() == ["tokens", "pixel_values", "image_grid_thw"] and sent.meta == {"step": 1}
    assert torch.equal(sent["tokens"], batch["tokens"]) and sent["pixel_values"][1] is None
    assert "response" in batch  # the driver's batch keeps its texts
