"""Reward-model inputs and RL's use of its scores, without workers: preference files in the public layouts, malformed
rows named by file, row and field (or skipped and counted), train_rm's --help, --check-config and --dry-run, and the
normalisation and mixing of scores."""

import json
import math

import pytest
import torch

from megarl.config import ConfigError
from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.data.dataset import PromptLimit
from megarl.data.files import InputError, write_records
from megarl.data.preferences import PairOptions, load_preference_file, pair_batch, task_preferences
from megarl.models.tiny import build_char_tokenizer
from megarl.protocol import Batch
from megarl.rewards.mixing import RunningMoments, ScoreMixer, ends_with, normalize_group, rule_agreement

from tests.conftest import QUICKSTART

# a chat template the character tokenizer can render: "<user>hi\n<assistant>yo\n"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_public_layouts_read_as_they_are(tmp_path, tokenizer):
    user, answer = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}
    rows = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},  # prompt/chosen/rejected strings
        {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"},  # HH
        # UltraFeedback-binarized: whole conversations; its prompt string is a copy, not read again
        {"prompt": "2+2?", "chosen": [user, answer], "rejected": [user, {"role": "assistant", "content": "5"}],
         "score_chosen": 9.0},
        # TRL's conversational layout with an explicit prompt: the prompt's turns, then the response's
        {"prompt": [user], "chosen": [answer], "rejected": [{"role": "assistant", "content": "5"}]},
    ]
    path = tmp_path / "pairs.jsonl"
    write_records(path, rows)
    pairs = load_preference_file(path, tokenizer, PairOptions())
    assert [text(tokenizer, p.chosen) for p in pairs] == [
        "2+2=4<eos>", "\n\nHuman: 2+2?\n\nAssistant: 4<eos>", "<user>2+2?\n<assistant>4\n<eos>",
        "<user>2+2?\n<assistant>4\n<eos>"]
    assert text(tokenizer, pairs[0].rejected) == "2+2=5<eos>"
    assert pairs[1].split_key == "\n\nHuman: 2+2?\n\nAssistant: "  # no prompt: the text both sides share
    assert pairs[2].origin == f"{path}, row 3"
    write_records(tmp_path / "ultrafeedback.parquet", [rows[2], rows[2]])  # one layout per parquet file
    from_parquet = load_preference_file(tmp_path / "ultrafeedback.parquet", tokenizer, PairOptions())
    assert [(p.chosen, p.rejected) for p in from_parquet] == [(pairs[2].chosen, pairs[2].rejected)] * 2
    # a string prompt and responses as chat turns (preference.chat_template), and no EOS appended
    pairs = load_preference_file(tmp_path / "pairs.jsonl", tokenizer, PairOptions(chat_template=True, append_eos=False))
    assert text(tokenizer, pairs[0].chosen) == "<user>2+2=\n<assistant>4\n"
    # rows 2k, 2k+1: chosen and rejected, right-padded; the engine's bradley_terry layout
    batch = pair_batch(pairs[:2], tokenizer.pad_token_id)
    assert batch["attention_mask"].sum(1).tolist() == [len(pairs[0].chosen), len(pairs[0].rejected),
                                                       len(pairs[1].chosen), len(pairs[1].rejected)]


def test_malformed_rows_are_named_or_skipped_and_counted(tmp_path, tokenizer):
    good = {"prompt": "a>", "chosen": "a", "rejected": "b"}
    bad = [  # (row, expected message)
        ({"prompt": "a>", "chosen": "a"}, "field 'rejected' is missing (the row has chosen, prompt)"),
        ({"prompt": "a>", "chosen": 3, "rejected": "b"}, "field 'chosen' must be a string or a list of chat messages"),
        ({"chosen": [{"role": "user"}], "rejected": "b"}, "field 'chosen' is a list but not of chat messages"),
        ({"chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
         "field 'chosen' ends with a 'user' message: the last must be the assistant's response"),
        ({"chosen": [{"role": "assistant", "content": "x"}], "rejected": "b"},
         "field 'prompt' is missing, and 'chosen' holds no prompt"),
        ({"prompt": "a>", "chosen": "a", "rejected": "a"}, "field 'chosen' equals field 'rejected'"),
        ({"prompt": "a>", "chosen": "é", "rejected": "b"}, "field 'chosen' has characters the tokenizer cannot encode"),
        ({"prompt": "a>", "chosen": "a" * 40, "rejected": "b"}, "field 'chosen' is 43 tokens, over the limit of 16"),
    ]
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(good)] + [json.dumps(row) for row, _ in bad] + ["{not json"]
    path.write_text("\n".join(lines) + "\n")
    limit = PromptLimit(16, "preference.max_length=16")
    for i, (_, message) in enumerate(bad, start=2):
        single = tmp_path / f"row{i}.jsonl"
        single.write_text(lines[0] + "\n" + lines[i - 1] + "\n")
        with pytest.raises(InputError) as e:
            load_preference_file(single, tokenizer, PairOptions(limit=limit))
        assert str(e.value).startswith(f"{single}, row 2: {message}"), str(e.value)
    skipped = []
    pairs = load_preference_file(path, tokenizer, PairOptions(limit=limit, skip_malformed=True), skipped)
    assert len(pairs) == 1 and len(skipped) == len(bad) + 1
    assert skipped[-1] == f"{path}, row {len(lines)}: not valid JSON (Expecting property name enclosed in double quotes)"
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text(lines[1] + "\n")
    with pytest.raises(InputError, match="no usable preference pairs \\(1 malformed rows skipped; the first: "):
        load_preference_file(only_bad, tokenizer, PairOptions(skip_malformed=True))
    # config keys are checked by name
    with pytest.raises(ConfigError, match=r"preference.pairs_per_step=0: must be in \[1, 1000000\]"):
        tiny_config(["preference.pairs_per_step=0"])
    with pytest.raises(ConfigError, match="reward_model.normalize='batch': must be one of none, running, group"):
        tiny_config(["reward_model.normalize=batch"])


def test_train_rm_help_and_config_check(capsys):
    from megarl.train_rm import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--dry-run" in out and "preference.skip_malformed = False" in out
    assert "reward_model.normalize = 'none'" in out and "rollout.engine" not in out  # only the keys train_rm reads
    assert "[reward_model.parallel]  layout of the reward model's ranks" in out  # not the policy's (ActorConfig's)
    assert main(["--config", str(QUICKSTART.with_name("rm_quickstart.yaml")), "--check-config"]) == 0
    assert capsys.readouterr().out == ("config ok: world_size=1 = tp 1 x pp 1 x cp 1 x dp 1; 3000 steps of 64 "
                                       "preference pairs\n")
    # each data-parallel rank trains on whole pairs
    assert main(["--check-config", *TINY_ARGS, "reward_model.parallel.world_size=2", "preference.pairs_per_step=3"]) == 2
    assert "preference.pairs_per_step=3 must be divisible by the reward model's data-parallel size 2" in \
        capsys.readouterr().err


def test_train_rm_dry_run_names_a_malformed_row_or_skips_and_counts_it(tmp_path, capsys):
    from megarl.train_rm import main

    rows = [{"prompt": f"{w}>", "chosen": w[::-1], "rejected": w} for w in ("abc", "xyz", "pqrs")]
    write_records(tmp_path / "val.jsonl", rows)
    write_records(tmp_path / "train.parquet", rows + [{"prompt": "ab>", "chosen": "ba", "rejected": None}])
    dry_run = ["--dry-run", *TINY_ARGS, f"trainer.output_dir={tmp_path / 'rm'}",
               f"preference.train={tmp_path / 'train.parquet'}", f"preference.val={tmp_path / 'val.jsonl'}"]
    assert main(dry_run) == 2
    assert capsys.readouterr().err == f"input error: {tmp_path / 'train.parquet'}, row 4: field 'rejected' is null\n"
    assert main(dry_run + ["preference.skip_malformed=true"]) == 0
    out = capsys.readouterr().out
    assert "pairs ok: 3 training, 3 held-out, 1 skipped (preference.skip_malformed)" in out
    assert f"\n  skipped {tmp_path / 'train.parquet'}, row 4: field 'rejected'" in out
    assert not (tmp_path / "rm").exists()  # a dry run writes nothing


def test_task_preferences_prefer_the_answer_to_a_wrong_one():
    rows = task_preferences("reverse", 200, seed=1, split="train", min_len=3, max_len=5)
    assert all(r["chosen"] == r["prompt"][:-1][::-1] != r["rejected"] for r in rows)
    # a near miss (one letter replaced, swapped, dropped or added), a run-on by 2-3 letters, or the word unreversed
    near = [r for r in rows if abs(len(r["rejected"]) - len(r["chosen"])) <= 1 and r["rejected"] != r["prompt"][:-1]]
    run_on = [r for r in rows if r["rejected"].startswith(r["chosen"]) and len(r["rejected"]) - len(r["chosen"]) > 1]
    assert len(near) + len(run_on) + sum(r["rejected"] == r["prompt"][:-1] for r in rows) == len(rows)
    assert 0.5 < len(near) / len(rows) < 0.8 and run_on
    assert rows == task_preferences("reverse", 200, seed=1, split="train", min_len=3, max_len=5)


def test_score_normalisation_and_mixing():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 3 + 2 for n in (5, 1, 8)]
    moments = RunningMoments()
    for b in batches:
        moments.update(b)
    every = torch.cat(batches).double()
    assert moments.count == 14
    assert math.isclose(moments.mean, every.mean().item(), rel_tol=1e-12)
    assert math.isclose(moments.std, every.std().item(), rel_tol=1e-12)

    # running: each step normalised by the moments of every score so far, its own included
    mixer = ScoreMixer("running", weight=2.0, rule_weight=0.5)
    rule = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    rewards, metrics = mixer(batches[0], rule, [0] * 5)
    expected = 2.0 * (batches[0] - batches[0].mean()) / (batches[0].std() + 1e-6) + 0.5 * rule
    torch.testing.assert_close(rewards, expected)
    assert metrics["train/rule_reward"] == pytest.approx(0.4) and metrics["train/rm_score"] == pytest.approx(
        batches[0].mean().item())
    resumed = ScoreMixer("running", weight=2.0, rule_weight=0.5)
    resumed.load_state_dict(json.loads(json.dumps(mixer.state_dict())))  # as a checkpoint keeps it
    second = [m(batches[2], torch.zeros(8), [0] * 8)[0] for m in (mixer, resumed)]
    assert torch.equal(second[0], second[1])
    both = torch.cat([batches[0], batches[2]])
    torch.testing.assert_close(second[0], 2.0 * (batches[2] - both.mean()) / (both.std() + 1e-6))

    # group: within each prompt's group; a sample alone in its group gets 0
    scores, groups = torch.tensor([1.0, 3.0, 10.0, 20.0, 30.0, 7.0]), [0, 0, 1, 1, 1, 2]
    torch.testing.assert_close(normalize_group(scores, groups),
                               torch.tensor([-0.7071, 0.7071, -1.0, 0.0, 1.0, 0.0]), atol=1e-4, rtol=0)
    rewards, _ = ScoreMixer("group", weight=1.0, rule_weight=0.0)(scores, torch.zeros(6), groups)
    torch.testing.assert_close(rewards, normalize_group(scores, groups))
    # none, weight 1, rule weight 0: the model's score as it is (what RL did before mixing existed)
    rewards, _ = ScoreMixer()(scores, torch.ones(6), groups)
    assert torch.equal(rewards, scores)

    # missing_eos_penalty: off the raw score of a response whose last real token is not EOS (1), before normalising
    rows = Batch({"tokens": torch.tensor([[5, 6, 1, 0], [5, 6, 7, 8], [5, 1, 0, 0]]),
                  "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])})
    ended = ends_with(rows, 1)
    assert ended.tolist() == [True, False, True]
    rewards, metrics = ScoreMixer(missing_eos_penalty=5.0)(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3), [0] * 3, ended)
    assert rewards.tolist() == [1.0, -3.0, 3.0]
    assert metrics["train/unfinished"] == pytest.approx(1 / 3) and metrics["train/rm_score"] == pytest.approx(2.0)

    # agreement with the rule within groups: (3 > 1) and (3 > 2) agree with the rule's 1 > 0; 5 = 5 is a tie (half)
    assert rule_agreement(torch.tensor([3.0, 1.0, 2.0, 5.0, 5.0]), torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]),
                          [0, 0, 0, 1, 1]) == pytest.approx(2.5 / 3)
    assert math.isnan(rule_agreement(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), [0, 0]))


def test_a_pair_stays_on_one_data_parallel_rank():
    from types import SimpleNamespace

    from megarl.protocol import Batch
    from megarl.workers.group import TrainGroup

    lengths = [3, 9, 4, 4, 8, 2, 5, 7]  # rows 2k, 2k+1: one pair
    mask = (torch.arange(10)[None] < torch.tensor(lengths)[:, None]).long()
    batch = Batch({"tokens": mask, "attention_mask": mask})
    for packed in (0, 64):  # equal consecutive chunks; packing's token-balanced split
        group = SimpleNamespace(section=SimpleNamespace(max_tokens_per_micro_batch=packed), dp=2)
        for rows in TrainGroup._rows_per_rank(group, batch, 2):
            assert len(rows) == 4 and all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1 for i in (0, 2)), rows
    group = SimpleNamespace(section=SimpleNamespace(max_tokens_per_micro_batch=0), dp=8)  # a row each
    with pytest.raises(ValueError, match="whole groups of 2 rows"):
        TrainGroup._rows_per_rank(group, batch, 2)
