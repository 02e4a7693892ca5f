import pytest

from megarl.config import DataConfig
from megarl.data.tasks import load_examples, make_task, split_of


@pytest.mark.parametrize("name", ["reverse", "add"])
def test_splits_are_disjoint_and_deterministic(name):
    task = make_task(name, min_len=1, max_len=3)
    train = task.make_examples(2000, seed=0, split="train")
    val = task.make_examples(200, seed=0, split="val")
    assert len({e["prompt"] for e in train}) == 2000 and len({e["prompt"] for e in val}) == 200
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in val}
    assert all(split_of(e["prompt"]) == "val" for e in val)
    assert task.make_examples(2000, seed=0, split="train") == train
    assert task.make_examples(2000, seed=1, split="train") != train
    # a different seed draws other validation prompts, still never a training one of any seed
    other_train = task.make_examples(2000, seed=1, split="train")
    assert not {e["prompt"] for e in other_train} & {e["prompt"] for e in val}


def test_reverse_examples():
    task = make_task("reverse", min_len=2, max_len=4, alphabet="abc")
    for ex in task.make_examples(30, seed=5):
        word = ex["prompt"][:-1]
        assert ex["prompt"].endswith(">") and 2 <= len(word) <= 4 and set(word) <= set("abc")
        assert ex["answer"] == word[::-1]


def test_add_examples():
    for ex in make_task("add", min_len=1, max_len=3).make_examples(100, seed=0):
        a, b = ex["prompt"].rstrip("=").split("+")
        assert ex["prompt"].endswith("=") and len(ex["prompt"]) <= 8 and len(a) <= 3 and len(b) <= 3
        assert int(ex["answer"]) == int(a) + int(b)


def test_too_small_example_space_is_an_error():
    with pytest.raises(ValueError, match="too few distinct"):
        make_task("reverse", min_len=1, max_len=1, alphabet="ab").make_examples(5, seed=0)
    with pytest.raises(KeyError, match="unknown task 'revers'"):
        make_task("revers")


def test_load_examples_from_a_prompt_file(tmp_path):
    rows = [f'{{"prompt": "q{i}", "answer": "a{i}"}}' for i in range(200)]
    (tmp_path / "p.jsonl").write_text("\n".join(rows) + "\n")
    train, val = load_examples(DataConfig(task=str(tmp_path / "p.jsonl")), seed=0)
    assert len(train) + len(val) == 200 and val and not {e["prompt"] for e in train} & {e["prompt"] for e in val}
    train, val = load_examples(DataConfig(task="reverse", val_size=16), seed=0)
    assert len(val) == 16 and len(train) > 1000
