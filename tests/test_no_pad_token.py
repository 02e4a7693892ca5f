"""A tokenizer without a pad token (Llama 3 and many others): megarl pads with its EOS token, as verl does, in every
process that loads it, so the run goes through its first generation and update."""

import json
import shutil

import pytest

from megarl.config.tiny import tiny_config
from megarl.data.files import InputError
from megarl.data.inputs import load_tokenizer
from megarl.models.tiny import EOS_TOKEN, PAD_TOKEN, build_tiny_model
from megarl.trainer import RLTrainer
from megarl.utils.tracking import run_dir

from tests.conftest import QUICKSTART


def edit_json(path, **changes):
    """The JSON object in file `path` with `changes` made (None is written as null: no such token)."""
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.fixture(scope="module")
def no_pad_model(tmp_path_factory):
    """The tiny model with no pad token anywhere: tokenizer (null, as Llama 3's; Qwen2Tokenizer would otherwise add
    a pad token of its own), config.json and generation_config.json."""
    model = tmp_path_factory.mktemp("no_pad") / "model"
    shutil.copytree(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"), model)
    (model / "megarl_tiny.json").unlink()  # an ordinary model directory now, not a tiny-model build
    edit_json(model / "tokenizer_config.json", pad_token=None)
    edit_json(model / "config.json", pad_token_id=None)
    edit_json(model / "generation_config.json", pad_token_id=None)
    return model


def test_load_tokenizer_pads_with_eos(no_pad_model, tmp_path):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(no_pad_model).pad_token_id is None  # the model as it comes
    tokenizer = load_tokenizer(str(no_pad_model))
    assert tokenizer.pad_token == EOS_TOKEN and tokenizer.pad_token_id == tokenizer.eos_token_id == 1
    # neither pad nor eos: nothing to pad rows with, nothing to end a response: the directory is named
    broken = tmp_path / "broken"
    shutil.copytree(no_pad_model, broken)
    edit_json(broken / "tokenizer_config.json", eos_token=None)
    edit_json(broken / "generation_config.json", eos_token_id=None)  # else its eos would be taken
    with pytest.raises(InputError, match=rf"model.path={broken}: its tokenizer has neither a pad token nor an eos"):
        load_tokenizer(str(broken))


def test_load_tokenizer_ends_with_the_generation_eos(no_pad_model, tmp_path):
    """A tokenizer whose eos is not among generation_config.json's eos ids (transformers' GGUF import of SmolLM2
    makes its bos its eos): megarl's tokenizer ends and pads with the token generation stops at."""
    model = tmp_path / "model"
    shutil.copytree(no_pad_model, model)
    edit_json(model / "tokenizer_config.json", eos_token=PAD_TOKEN)  # id 0, generation_config.json says 1
    tokenizer = load_tokenizer(str(model))
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS_TOKEN, 1, 1)
    edit_json(model / "generation_config.json", eos_token_id=[7, 1])  # a list that holds the tokenizer's: kept
    edit_json(model / "tokenizer_config.json", eos_token=EOS_TOKEN)
    assert load_tokenizer(str(model)).eos_token_id == 1


def test_a_run_with_no_pad_token_finishes(no_pad_model, tmp_path, ray_local):
    cfg = tiny_config([f"model.path={no_pad_model}", "trainer.steps=1", "sft.steps=1",
                                   "data.prompts_per_step=4", "rollout.n_samples=2", "data.val_size=4",
                                   "actor.micro_batch_size=8", "trainer.loggers=jsonl",
                                   f"trainer.output_dir={tmp_path}"], path=QUICKSTART)
    trainer = RLTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert sorted(history["val/reward"]) == [0, 1]  # evaluated before RL and after its one step
    step = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and "train/grad_norm" in step
