"""A tokenizer whose end-of-sequence token is not among generation_config.json's eos ids (what transformers' GGUF
import writes) is named by the dry run and at a run's start, with the tokens responses stop at and megarl's own."""

import json
import shutil

import pytest

from megarl.config.tiny import TINY_RUN
from megarl.data.inputs import eos_disagreement, load_tokenizer
from megarl.models.tiny import EOS_TOKEN, build_tiny_model
from megarl.train import main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny model as built (tokenizer and generation config agree), and a copy whose generation config stops
    at another token."""
    agreeing = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    disagreeing = tmp_path_factory.mktemp("gguf_like") / "model"
    shutil.copytree(agreeing, disagreeing)
    (disagreeing / "megarl_tiny.json").unlink()  # an ordinary model directory now, not a tiny-model build
    tokenizer = load_tokenizer(agreeing)
    eos = tokenizer.eos_token_id
    other = next(i for i in range(len(tokenizer)) if i not in (eos, tokenizer.pad_token_id))
    config = json.loads((disagreeing / "generation_config.json").read_text())
    (disagreeing / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": other}))
    return agreeing, disagreeing, eos, other


def test_the_disagreement_names_both_tokens(models):
    agreeing, disagreeing, eos, other = models
    assert eos_disagreement(str(agreeing), load_tokenizer(agreeing), "hf") is None
    tokenizer = load_tokenizer(disagreeing)
    line = eos_disagreement(str(disagreeing), tokenizer, "hf")
    stop = tokenizer.convert_ids_to_tokens(other)
    assert f"its tokenizer's end-of-sequence token {EOS_TOKEN!r} (id {eos}) is not among generation_config.json's " \
           f"eos_token_id: responses stop at {stop!r} (id {other});" in line
    assert f"megarl's eos token (warm-start targets, tool-turn ends, padding, reward_model.missing_eos_penalty) is " \
           f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id})" in line
    assert ("ends no response" in line) == (tokenizer.eos_token_id != other)
    assert "under SGLang" in eos_disagreement(str(disagreeing), tokenizer, "sglang")


def test_the_dry_run_warns_of_it(models, capsys):
    _, disagreeing, eos, other = models
    args = [f"{k}={v}" for k, v in TINY_RUN.items()] + ["reward.name=exact_match", f"model.path={disagreeing}"]
    assert main(["--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert f"\nwarning: model.path={disagreeing}: its tokenizer's end-of-sequence token {EOS_TOKEN!r} (id {eos})" in out


def test_the_config_check_warns_of_it_where_the_model_is_on_the_machine(models, capsys):
    _, disagreeing, eos, _ = models
    args = [f"{k}={v}" for k, v in TINY_RUN.items()] + ["reward.name=exact_match", f"model.path={disagreeing}"]
    assert main(["--check-config", *args]) == 0
    assert f"\nwarning: model.path={disagreeing}: its tokenizer's end-of-sequence token" in capsys.readouterr().out
    assert main(["--check-config", *args[:-1], f"model.path={disagreeing.parent / 'elsewhere'}"]) == 0
    assert "end-of-sequence" not in capsys.readouterr().out  # no model directory needed, none read
