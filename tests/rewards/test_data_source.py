"""The reward follows each row's data_source as verl's default scorer does: each family's scorer on a right and a
wrong response, an unknown source named, and a verl-layout prompt file's data_source and extra_info reaching the
reward's samples."""

import json

import pytest

from megarl.config import ConfigError, RewardConfig
from megarl.config.tiny import tiny_config
from megarl.data.dataset import load_prompt_file
from megarl.data.files import write_records
from megarl.rewards import build_reward, score
from megarl.rewards.data_source import DataSourceReward
from megarl.rewards.loading import check_reward
from megarl.rollout.base import Generation
from megarl.rollout.batching import generations_to_batch
from megarl.rollout_buffer import prompt_record

STDIN_SUM = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]})
SUM_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"

# (data_source, ground truth, right response, wrong response, right's reward, wrong's reward)
FAMILIES = [
    ("openai/gsm8k", "72", "6 * 12 = 72\n#### 72", "#### 71", 1.0, 0.0),
    ("openai/gsm8k", "72", "6 * 12 = 72\n#### 72", "the answer is 72", 1.0, 0.0),  # no `####`: no format credit
    ("lighteval/MATH", "\\frac{1}{2}", "so \\boxed{0.5}", "so \\boxed{2}", 1.0, 0.0),
    ("DigitalLearningGmbH/MATH-lighteval", "3\\sqrt{2}", "\\boxed{\\sqrt{18}}", "\\boxed{18}", 1.0, 0.0),
    ("HuggingFaceH4/MATH-500", "10", "\\boxed{10}", "\\boxed{11}", 1.0, 0.0),
    ("math_dapo", "1000", "...\nAnswer: 1,000 dollars", "Answer: 999", 1.0, -1.0),
    ("math", "34", "Answer: 34", "no answer at all", 1.0, -1.0),
    ("aime2024", "204", "the total is \\boxed{204}", "Answer: 0.5", 1.0, -1.0),
    ("numina_olympiads", "\\frac{3}{4}", "\\boxed{0.75}", "\\boxed{3/5}", 1.0, 0.0),
    ("deepmind/math_dataset", "-2/7", "-4/14 = -2/7", "the answer is 2/7", 1.0, 0.0),  # the last expression
    ("hiyouga/geometry3k", "4\\sqrt{3}", "<think>30-60-90</think> \\boxed{\\sqrt{48}}", "<think>x</think> \\boxed{4}",
     1.0, 0.1),
    ("hiyouga/geometry3k", "4\\sqrt{3}", "\\boxed{4\\sqrt{3}}", "4\\sqrt{3}", 0.9, 0.0),  # no think; no box
    ("searchR1_nq", {"target": ["Eiffel Tower", "La tour Eiffel"]}, "<answer> The Eiffel Tower. </answer>",
     "<answer>Louvre</answer>", 1.0, 0.0),
    ("searchR1_bamboogle", {"target": ["1889"]}, "<answer>1888</answer><answer>1889</answer>", "1889", 1.0, 0.0),
    ("apps", STDIN_SUM, SUM_PROGRAM, "```python\nprint(3)\n```", 1.0, 0.0),
    ("codecontests", json.loads(STDIN_SUM), SUM_PROGRAM, "```python\nprint(4)\n```", 1.0, 0.0),
]


def samples_of(families):
    return [{"prompt": "p", "response": response, "answer": truth, "data_source": source, "extra_info": {}}
            for source, truth, right, wrong, _, _ in families for response in (right, wrong)]


@pytest.fixture(scope="module")
def router():
    reward = build_reward(RewardConfig(name="data_source", isolation="none", code_timeout_s=5.0, code_memory_mb=256,
                                       num_workers=2))
    yield reward
    reward.close()


def test_each_family_scores_a_right_and_a_wrong_response(router):
    scores = score(samples_of(FAMILIES), router, timeout_s=60, num_workers=2)
    assert scores.failed == 0, [f.describe() for f in scores.failures]
    expected = [reward for *_, right, wrong in FAMILIES for reward in (right, wrong)]
    assert list(zip([f[0] for f in FAMILIES for _ in (0, 1)], scores.rewards)) == \
        list(zip([f[0] for f in FAMILIES for _ in (0, 1)], expected))


def test_in_reward_processes_and_with_unknown_sources_among_them():
    cheap = [f for f in FAMILIES if f[0] in ("openai/gsm8k", "math_dapo", "searchR1_nq")]
    samples = samples_of(cheap)
    samples.insert(2, {"response": "x", "answer": "x", "data_source": "my_private_set", "extra_info": {}})
    samples.append({"response": "x", "answer": "x"})  # a row with no data_source
    reward = build_reward(RewardConfig(name="data_source", isolation="process"))
    try:
        scores = score(samples, reward, timeout_s=60, num_workers=2)
    finally:
        reward.close()
    expected = [reward for *_, right, wrong in cheap for reward in (right, wrong)]
    assert scores.rewards == expected[:2] + [0.0] + expected[2:] + [0.0]
    assert [f.index for f in scores.failures] == [2, len(samples) - 1]
    assert "data_source 'my_private_set' has no built-in scorer" in str(scores.failures[0].error)
    assert "set reward.name or custom_reward_function.path" in str(scores.failures[0].error)
    assert "the row has no data_source" in str(scores.failures[1].error)


def test_call_based_code_tests_are_a_named_failure(router):
    call_based = json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})
    scores = score([{"response": SUM_PROGRAM, "answer": call_based, "data_source": "taco"}], router, timeout_s=60)
    assert scores.failed == 1 and "call-based tests (fn_name='add')" in str(scores.failures[0].error)


VERL_ROWS = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "6 x 12?"}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}},
    {"data_source": "searchR1_nq", "prompt": [{"role": "user", "content": "Where?"}], "ability": "fact-reasoning",
     "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris"]}}, "extra_info": {"split": "train",
                                                                                               "index": 1}},
]


class CharTokenizer:
    """Token ids are character codes (generations_to_batch decodes the responses)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_verl_prompt_file_reaches_the_reward_by_data_source(tmp_path, isolation):
    path = tmp_path / "train.jsonl"  # a parquet column cannot mix gsm8k's string and search's struct ground truths
    write_records(path, VERL_ROWS)
    write_records(tmp_path / "search.parquet", VERL_ROWS[1:])
    assert load_prompt_file(tmp_path / "search.parquet")[0]["answer"] == {"target": ["Paris"]}
    prompts = [dict(row, prompt_ids=[1, 2]) for row in load_prompt_file(path)]
    responses = ["#### 72", "#### 7", "<answer>paris</answer>", "<answer>Rome</answer>"]
    generations = [Generation(i // 2, [ord(c) for c in text], [0.0] * len(text), "length")
                   for i, text in enumerate(responses)]
    batch = generations_to_batch(prompts, generations, 0, 0, CharTokenizer())
    assert batch["data_source"] == ["openai/gsm8k"] * 2 + ["searchR1_nq"] * 2
    assert batch["extra_info"][2] == {"split": "train", "index": 1}
    regenerated = prompt_record(batch.index([2, 3]))  # a stale group's prompt, sent back to the rollout (async)
    assert (regenerated["data_source"], regenerated["extra_info"]) == ("searchR1_nq", {"split": "train", "index": 1})
    cfg = tiny_config([f"data.task={path}", f"reward.isolation={isolation}"])
    reward = build_reward(cfg.reward, cfg.data.task)  # reward.name empty: each row's data_source
    try:
        assert isinstance(reward, DataSourceReward)
        assert score(batch, reward, timeout_s=60).rewards == [1.0, 0.0, 1.0, 0.0]
    finally:
        reward.close()
    assert check_reward(cfg, load_prompt_file(path)[0]) == "reward: by data_source (openai/gsm8k -> gsm8k)"
    assert check_reward(cfg, None) == "reward: by each row's data_source (verl's default scorer)"


def test_check_reward_names_an_unknown_data_source_with_its_file_and_row(tmp_path):
    path = tmp_path / "train.jsonl"
    write_records(path, [dict(VERL_ROWS[0], data_source="my_private_set")])
    cfg = tiny_config([f"data.task={path}"])
    with pytest.raises(ConfigError) as error:
        check_reward(cfg, load_prompt_file(path)[0])
    assert str(error.value).startswith(
        f"reward.name is empty, so the reward follows each row's data_source: {path}, row 1: data_source "
        "'my_private_set' has no built-in scorer")
    assert str(error.value).endswith("set reward.name or custom_reward_function.path to score it")
    with pytest.raises(ConfigError, match=f"^reward.name='data_source': {path}, row 1: data_source 'my_private_set'"):
        check_reward(tiny_config([f"data.task={path}", "reward.name=data_source"]), load_prompt_file(path)[0])
    write_records(path, [{"prompt": "6 x 12?", "answer": "72"}])
    with pytest.raises(ConfigError, match=f"{path}, row 1: the row has no data_source for the reward to follow"):
        check_reward(cfg, load_prompt_file(path)[0])


def test_check_reward_tries_the_routed_scorer_on_the_first_row(tmp_path):
    cfg = tiny_config([f"data.task={tmp_path / 'train.parquet'}"])
    bad = dict(VERL_ROWS[0], reward_model={"ground_truth": "seventy-two"})
    with pytest.raises(ConfigError, match="data_source 'openai/gsm8k' -> gsm8k: the call on .* failed: ValueError: "
                                          "GSM8K reference answer 'seventy-two' is not a number"):
        check_reward(cfg, bad)
    code_row = dict(VERL_ROWS[0], data_source="apps", reward_model={"ground_truth": "[1, 2]"})
    with pytest.raises(ConfigError, match="data_source 'apps': .*: code reference must be a JSON object, got list"):
        check_reward(cfg, code_row)
    assert check_reward(cfg, dict(code_row, reward_model={"ground_truth": STDIN_SUM})) == \
        "reward: by data_source (apps -> code)"
