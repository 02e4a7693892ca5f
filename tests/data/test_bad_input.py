"""Bad prompt input is named at load time (file and row, or task and example, with the limit), or skipped and
counted under data.skip_malformed: invalid UTF-8, corrupt parquet, empty prompts, characters the tokenizer
cannot encode."""

import json
import logging
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megarl.data.dataset import PromptDataset, load_prompt_file
from megarl.data.files import write_records
from megarl.models.tiny import build_tiny_model

GOOD = b'{"prompt": "ab>", "answer": "ba"}'
BAD_UTF8 = b'{"prompt": "a\xff\xfeb>", "answer": "ba"}'  # 0xff never starts a UTF-8 character


def write_parquet_with_raw_prompts(path, prompts: list[bytes]):
    """A parquet string column holding the given bytes unchecked, as a foreign writer may leave it."""
    offsets = [0]
    for p in prompts:
        offsets.append(offsets[-1] + len(p))
    buffers = [None, pa.py_buffer(struct.pack(f"{len(offsets)}i", *offsets)), pa.py_buffer(b"".join(prompts))]
    column = pa.Array.from_buffers(pa.string(), len(prompts), buffers)
    pq.write_table(pa.table({"prompt": column, "answer": ["x"] * len(prompts)}), path)


def write_with_invalid_utf8_in_row_2(path):
    if path.suffix == ".jsonl":
        path.write_bytes(b"\n".join([GOOD, BAD_UTF8, GOOD]) + b"\n")
    elif path.suffix == ".json":
        path.write_bytes(b"[" + b", ".join([GOOD, BAD_UTF8, GOOD]) + b"]")
    else:
        write_parquet_with_raw_prompts(path, [b"ab>", b"a\xff\xfeb>", b"cd>"])


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_invalid_utf8_names_the_row_or_is_skipped_and_counted(tmp_path, suffix, caplog):
    from megarl.data.files import iter_records

    path = tmp_path / f"p{suffix}"
    write_with_invalid_utf8_in_row_2(path)
    rows = list(iter_records(path))
    assert [row for row, _ in rows] == [1, 2, 3] and isinstance(rows[0][1], dict) and isinstance(rows[2][1], dict)
    assert str(rows[1][1]).startswith(f"{path}, row 2: not valid UTF-8")
    if suffix == ".json":
        return  # load_prompt_file reads .jsonl and .parquet; preprocess reads .json through iter_records
    with pytest.raises(ValueError, match=rf"p\{suffix}, row 2: not valid UTF-8"):
        load_prompt_file(path)
    with caplog.at_level(logging.WARNING):
        assert len(load_prompt_file(path, skip_malformed=True)) == 2
    assert "skipped 1 malformed rows" in caplog.text


def test_lone_surrogate_escape_is_a_malformed_row(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ab>", "answer": "ba"}) + "\n" + '{"prompt": "a\\ud800>", "answer": "x"}\n'
                    + json.dumps({"prompt": "\U0001F600>", "answer": "x"}) + "\n")  # an escaped pair is fine
    with pytest.raises(ValueError, match=r"row 2: holds a lone surrogate"):
        load_prompt_file(path)
    assert [e["prompt"] for e in load_prompt_file(path, skip_malformed=True)] == ["ab>", "\U0001F600>"]


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_corrupt_parquet_names_the_file(tmp_path, damage):
    path = tmp_path / "p.parquet"
    write_records(path, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)])
    data = path.read_bytes()
    half = len(data) // 2
    path.write_bytes(data[:half] if damage == "truncated" else data[:half] + b"\0" * 64 + data[half + 64:])
    with pytest.raises(ValueError, match=r"p\.parquet: not a readable parquet file"):
        load_prompt_file(path, skip_malformed=True)  # a broken file is no row to skip


EMPTY = [("", "field 'prompt' is empty"), ("  \n", "field 'prompt' is empty"),
         ([], "field 'prompt' is an empty list of chat messages"),
         ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " "}], "field 'prompt' is empty")]


@pytest.mark.parametrize("prompt,problem", EMPTY)
def test_empty_prompt_names_the_row(tmp_path, prompt, problem):
    path = tmp_path / "p.jsonl"
    write_records(path, [{"prompt": "ab>", "answer": "ba"}, {"prompt": prompt, "answer": "x"}])
    with pytest.raises(ValueError, match=rf"p\.jsonl, row 2: {problem}"):
        load_prompt_file(path)
    assert len(load_prompt_file(path, skip_malformed=True)) == 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_characters_the_tokenizer_drops_are_named(tokenizer):
    # the tiny tokenizer knows printable ASCII and newline: it drops 'é' and a tab without a word
    for prompt, lost in (("caf\u00e9>", "'é'"), ("a\tb>", r"'\\t'")):
        with pytest.raises(ValueError, match=rf"example 0: characters the tokenizer cannot encode .*: {lost}"):
            PromptDataset([{"prompt": prompt, "answer": "x"}], tokenizer, batch_size=1)


def test_a_prompt_of_no_tokens_is_named(tokenizer):
    with pytest.raises(ValueError, match=r"example 1: prompt '日本' has no tokens"):
        PromptDataset([{"prompt": "ab>", "answer": "ba"}, {"prompt": "日本", "answer": "x"}], tokenizer, batch_size=1)


def test_tokenizer_problems_name_the_file_row_or_are_skipped_and_counted(tmp_path, tokenizer, caplog):
    from megarl.data.dataset import PromptLimit

    path = tmp_path / "p.jsonl"
    write_records(path, [{"prompt": "ab>", "answer": "ba"}, {"prompt": "caf\u00e9>", "answer": "x"},
                         {"prompt": "abcdefgh>", "answer": "x"}])
    examples = load_prompt_file(path)
    with pytest.raises(ValueError, match=r"p\.jsonl, row 2: characters the tokenizer cannot encode"):
        PromptDataset(examples, tokenizer, batch_size=1)
    limit = PromptLimit(5, "the test's limit")
    with pytest.raises(ValueError, match=r"p\.jsonl, row 3: prompt is 9 tokens, over the limit of 5 \(the test's"):
        PromptDataset(examples[:1] + examples[2:], tokenizer, batch_size=1, max_prompt_tokens=limit)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(examples, tokenizer, batch_size=1, max_prompt_tokens=limit, skip_malformed=True)
    assert [e["prompt"] for e in ds.examples] == ["ab>"] and sorted(ds.skipped) == [1, 2]
    assert "skipped 2 of 3 prompts" in caplog.text


def test_characters_mapped_to_the_unknown_token_are_named():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{c: i + 1 for i, c in enumerate("abc>")}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    assert len(PromptDataset([{"prompt": "abc>", "answer": "x"}], tokenizer, batch_size=1)) == 1
    with pytest.raises(ValueError, match=r"example 0: characters the tokenizer cannot encode .*: 'z'"):
        PromptDataset([{"prompt": "abz>", "answer": "x"}], tokenizer, batch_size=1)
