import logging

import pytest
from transformers import AutoTokenizer

from megarl.config import DataConfig
from megarl.data.dataset import PromptDataset, load_prompt_file, render_prompt
from megarl.data.files import write_records
from megarl.data.tasks import load_examples
from megarl.models.tiny import build_tiny_model

# A ChatML template like Qwen2.5's, small enough to read
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
    tok.chat_template = CHATML
    return tok


ROWS = [{"prompt": "1+1=", "answer": "2"},
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": 4},                # messages; a number answer
        {"prompt": "3+3=", "reward_model": {"ground_truth": "6"}, "data_source": "x"}]  # verl's layout


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_prompt_files_in_both_formats(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    write_records(path, [ROWS[0], ROWS[2]])  # a parquet column holds one type: strings here, messages below
    assert [(e["prompt"], e["answer"]) for e in load_prompt_file(path)] == [("1+1=", "2"), ("3+3=", "6")]
    write_records(path, [ROWS[1]])
    assert load_prompt_file(path) == [{"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}]


def test_malformed_rows_stop_or_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "p.parquet"
    write_records(path, ROWS[:1] + [{"prompt": "4+4=", "answer": None}, {"prompt": None, "answer": "0"}] + ROWS[2:])
    with pytest.raises(ValueError, match=r"p.parquet, row 2: field 'answer' must be a string, got None"):
        load_prompt_file(path)
    with caplog.at_level(logging.WARNING):
        examples = load_prompt_file(path, skip_malformed=True)
    assert [e["answer"] for e in examples] == ["2", "6"]
    assert "skipped 2 malformed rows" in caplog.text and "row 2" in caplog.text
    cfg = DataConfig(task=str(path), val_task=str(path), skip_malformed=True)
    train, val = load_examples(cfg, seed=0)
    assert len(train) == len(val) == 2


def test_chat_template_renders_prompts(tokenizer):
    assert render_prompt(tokenizer, "1+1=", chat_template=False) == "1+1="
    assert render_prompt(tokenizer, "1+1=", chat_template=True, system_prompt="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "2+2="}]  # a list of messages is rendered whatever the option
    assert render_prompt(tokenizer, messages, chat_template=False) == "<|im_start|>user\n2+2=<|im_end|>\n" \
                                                                       "<|im_start|>assistant\n"
    ds = PromptDataset(load_examples_rows(), tokenizer, batch_size=2, chat_template=True)
    first = sorted(ds.next_batch(), key=lambda e: e["answer"])[0]
    assert first["prompt"].startswith("<|im_start|>user\n1+1=")
    assert first["prompt_ids"] == tokenizer(first["prompt"], add_special_tokens=False)["input_ids"]


def load_examples_rows():
    return [dict(r, answer=str(r.get("answer", "6"))) for r in ROWS]


def test_missing_chat_template_is_named(tokenizer):
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    with pytest.raises(ValueError, match="has none"):
        render_prompt(plain, [{"role": "user", "content": "x"}], chat_template=False)


def test_a_prompt_key_the_file_does_not_have_is_named_with_the_fields_it_has():
    from megarl.data.dataset import prompt_problem

    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1="}],
           "reward_model": {"ground_truth": "2"}}
    assert prompt_problem(row, "question") == ("no field 'question' (data.prompt_key); the row's fields: data_source, "
                                               "prompt, reward_model")
    assert prompt_problem(row, "prompt") is None
