import pytest
import torch
from transformers import AutoTokenizer

from megarl.data.dataset import PromptDataset, load_prompt_file, sft_batch
from megarl.data.tasks import make_task
from megarl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def examples():
    return make_task("reverse").make_examples(10, seed=0)


def test_batches_cover_each_epoch_once_in_a_new_order(tokenizer, examples):
    ds = PromptDataset(examples, tokenizer, batch_size=4, seed=0)
    seen = [ex["prompt"] for _ in range(5) for ex in ds.next_batch()]  # 20 = two epochs
    assert sorted(seen[:10]) == sorted(seen[10:]) == sorted(e["prompt"] for e in examples)
    assert seen[:10] != seen[10:]
    assert ds.state_dict() == {"epoch": 1, "position": 10, "seed": 0}  # the next epoch starts lazily
    first = ds.examples[0]
    assert first["prompt_ids"] == tokenizer(first["prompt"], add_special_tokens=False)["input_ids"]


def test_state_round_trip_resumes_at_the_same_position(tokenizer, examples):
    ds = PromptDataset(examples, tokenizer, batch_size=3, seed=7)
    for _ in range(4):  # into the second epoch
        ds.next_batch()
    state = ds.state_dict()
    expected = [ds.next_batch() for _ in range(5)]
    resumed = PromptDataset(examples, tokenizer, batch_size=3, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(5)] == expected


def test_malformed_row_names_file_and_row(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ab>", "answer": "ba"}\n\n{"prompt": "cd>"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl, row 3: field 'answer'"):
        load_prompt_file(path)
    path.write_text('{"prompt": "ab>", "answer": "ba"}\n{"prompt": "ab>", "answer": \n')
    with pytest.raises(ValueError, match=r"prompts.jsonl, row 2: not valid JSON"):
        load_prompt_file(path)
    path.write_text('{"prompt": "ab>", "answer": "ba"}\n')
    assert load_prompt_file(path) == [{"prompt": "ab>", "answer": "ba"}]


def test_sft_batch_layout(tokenizer):
    batch = sft_batch(tokenizer, [{"prompt": "abc>", "answer": "cba"}, {"prompt": "z>", "answer": "z"}])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert batch["tokens"][0].tolist() == enc("abc>cba") + [eos]
    assert batch["tokens"][1].tolist() == enc("z>z") + [eos] + [pad] * 4
    assert batch["attention_mask"].tolist() == [[1] * 8, [1] * 4 + [0] * 4]
    # targets: the answer tokens and the eos, nothing of the prompt or padding
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0]]
    assert batch["loss_mask"].dtype == torch.float32 and batch["answer"] == ["cba", "z"]
