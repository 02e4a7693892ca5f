"""verl's prompt-length options: data.max_prompt_length, data.truncation (error, left, right, middle) and
data.filter_overlong_prompts, on the character tokenizer (one token per character, so tokens are letters)."""

import logging

import pytest

from megarl.config import ConfigError
from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.data.dataset import PromptDataset, PromptLimit, load_prompt_file, truncate
from megarl.data.files import InputError, write_records
from megarl.data.inputs import prompt_datasets, prompt_limit
from megarl.models.tiny import build_char_tokenizer
from megarl.train import main

MODEL = {"max_position_embeddings": 128}  # the tiny model's
SHORT = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]  # 4 tokens each
LONG = [{"prompt": "abcdefghij", "answer": "x"}, {"prompt": "klmnopqrstu", "answer": "y"}]  # 10 and 11 tokens


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def prompt_file(tmp_path, rows, name="p.jsonl"):
    write_records(tmp_path / name, rows)
    return load_prompt_file(tmp_path / name)


def texts(dataset):
    return [ex["prompt"] for ex in dataset.examples]


@pytest.mark.parametrize("side, kept", [("left", ["ghij", "rstu"]), ("right", ["abcd", "klmn"]),
                                        ("middle", ["abij", "kltu"])])
def test_each_truncation_keeps_verls_tokens(tmp_path, tokenizer, side, kept):
    limit = PromptLimit(4, "data.max_prompt_length=4", truncation=side)
    ds = PromptDataset(prompt_file(tmp_path, LONG + SHORT[:1]), tokenizer, 1, max_prompt_tokens=limit)
    assert texts(ds) == kept + ["0+0="]  # a prompt within the limit is left as it is
    assert [ex["prompt_ids"] for ex in ds.examples[:2]] == [tokenizer(k)["input_ids"] for k in kept]
    assert not ds.skipped and not ds.overlong


def test_truncate_middle_with_an_odd_limit():
    ids = list(range(10))
    assert truncate(ids, 5, "middle") == [0, 1, 7, 8, 9]  # the first 5 // 2, the last 5 - 5 // 2
    assert truncate(ids, 5, "left") == [5, 6, 7, 8, 9] and truncate(ids, 5, "right") == [0, 1, 2, 3, 4]
    assert truncate(ids, 1, "middle") == [9]


def test_truncation_error_names_file_and_row(tmp_path, tokenizer):
    limit = PromptLimit(4, "data.max_prompt_length=4")
    with pytest.raises(InputError, match=r"p\.jsonl, row 2: prompt is 10 tokens, over the limit of 4 "
                                         r"\(data\.max_prompt_length=4\)"):
        PromptDataset(prompt_file(tmp_path, SHORT[:1] + LONG), tokenizer, 1, max_prompt_tokens=limit)


def test_filter_leaves_out_and_counts_in_one_line(tmp_path, tokenizer, caplog):
    limit = PromptLimit(4, "data.max_prompt_length=4", truncation="left", filter=True)  # filtering wins
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(prompt_file(tmp_path, SHORT[:2] + LONG), tokenizer, 1, max_prompt_tokens=limit)
    assert texts(ds) == ["0+0=", "1+1="]
    assert ds.overlong == {2: f"{tmp_path / 'p.jsonl'}, row 3: prompt is 10 tokens, over the limit of 4 "
                              "(data.max_prompt_length=4)",
                           3: f"{tmp_path / 'p.jsonl'}, row 4: prompt is 11 tokens, over the limit of 4 "
                              "(data.max_prompt_length=4)"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("left out 2 of 4 prompts over 4 tokens (data.max_prompt_length=4;")
    assert "the first: " + ds.overlong[2] in lines[0]
    with pytest.raises(InputError, match="no usable prompts: all 2 were skipped or left out"):
        PromptDataset(prompt_file(tmp_path, LONG), tokenizer, 1, max_prompt_tokens=limit)


def config(*overrides):
    return tiny_config(["rollout.max_new_tokens=8", *overrides])


def test_max_prompt_length_sets_the_limit_within_the_models_room():
    where = "m/config.json"
    limit = prompt_limit(config(), MODEL, where)  # 0: what the positions leave after the response budget
    assert (limit.tokens, limit.truncation, limit.filter) == (120, "error", False)
    limit = prompt_limit(config("data.max_prompt_length=50", "data.truncation=middle",
                                "data.filter_overlong_prompts=true"), MODEL, where)
    assert (limit.tokens, limit.why, limit.truncation, limit.filter) == (50, "data.max_prompt_length=50", "middle",
                                                                        True)
    assert prompt_limit(config("data.max_prompt_length=120"), MODEL, where).tokens == 120
    with pytest.raises(InputError, match=r"data\.max_prompt_length=121 with rollout\.max_new_tokens=8 runs past the "
                                         r"model's max_position_embeddings=128 \(m/config\.json\): at most 120"):
        prompt_limit(config("data.max_prompt_length=121"), MODEL, where)
    assert prompt_limit(config("data.max_prompt_length=300"), {}, where).tokens == 300  # no positions known
    assert prompt_limit(config(), {}, where) is None


@pytest.mark.parametrize("override, message", [
    ("data.truncation=both", r"data\.truncation='both': must be one of error, left, right, middle"),
    ("data.max_prompt_length=-1", r"data\.max_prompt_length=-1: must be in \[0, 10000000\] \(0 = what the model's "
                                 r"positions leave after the response budget\)"),
    ("rollout.top_k=0", r"rollout\.top_k=0: must be >= 1 or -1 \(-1 = all \(no top-k cut\)\)"),
    ("rollout.top_k=-2", r"rollout\.top_k=-2: must be >= 1 or -1"),
])
def test_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        config(override)


def test_run_prompts_count_what_the_filter_left_out(tmp_path, tokenizer, capsys):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    write_records(train, SHORT + LONG)
    write_records(val, SHORT[:2] + LONG[:1])
    overrides = [f"data.task={train}", f"data.val_task={val}", "reward.name=exact_match", "data.prompts_per_step=2",
                 "data.max_prompt_length=6", "data.filter_overlong_prompts=true"]
    cfg = config(*overrides)
    prompts = prompt_datasets(cfg, tokenizer, prompt_limit(cfg, MODEL, "m"))
    assert len(prompts.train) == len(prompts.sft) == 8 and len(prompts.val) == 2
    assert [p.split(": ")[0] for p in prompts.overlong] == [f"{train}, row 9", f"{train}, row 10", f"{val}, row 3"]
    assert prompts.left_out() == "3 prompts over 6 tokens (data.max_prompt_length=6) left out " \
                                 "(data.filter_overlong_prompts)"
    # the dry run's start-up line says it
    assert main(["--dry-run", *TINY_ARGS, "model.path=tiny", *overrides]) == 0
    assert "prompts ok: 8 training, 2 held-out, 3 prompts over 6 tokens (data.max_prompt_length=6) left out" \
        in capsys.readouterr().out
