"""Reward functions written for verl (`compute_score(data_source, solution_str, ground_truth, extra_info)`) named by a
file path, called as verl calls them in the driver and in reward processes, and check_reward's errors before a run."""

import textwrap

import pytest

from megarl.config import ConfigError, RewardConfig
from megarl.config.tiny import tiny_config
from megarl.rewards import build_reward, score
from megarl.rewards.loading import check_reward

# the same reward twice: verl's convention (data_source and extra_info used, so each must arrive) and megarl's
REWARDS_PY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    right = solution_str.strip() == ground_truth
    return right * extra_info["weight"] * (2.0 if data_source == "double" else 1.0)


def megarl_score(response, answer, sample):
    right = response.strip() == answer
    return right * sample["extra_info"]["weight"] * (2.0 if sample["data_source"] == "double" else 1.0)


def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth, "pred": solution_str}


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def keyword_names(solution_str, ground_truth):  # verl's names without data_source or extra_info
    return float(solution_str == ground_truth)


def two_args(response, answer):
    return 1.0


def keyword_only(response, answer, sample, *, scale):
    return scale


def needs_more(data_source, solution_str, ground_truth, extra_info, tokenizer):
    return 1.0


def raises_on_empty(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 / len(solution_str)
'''

SAMPLES = [{"response": " 72", "answer": "72", "data_source": "openai/gsm8k", "extra_info": {"weight": 0.5}},
           {"response": "71", "answer": "72", "data_source": "openai/gsm8k", "extra_info": {"weight": 0.5}},
           {"response": "x", "answer": "x", "data_source": "double", "extra_info": {"weight": 3.0}}]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARDS_PY)
    return path


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_verl_function_scores_as_its_megarl_twin(reward_file, isolation):
    scored = {}
    for name in ("compute_score", "megarl_score"):
        reward = build_reward(RewardConfig(name=f"{reward_file}:{name}", isolation=isolation))
        scored[name] = score(SAMPLES, reward, timeout_s=30, num_workers=2)
        assert scored[name].failed == 0, scored[name].failures
    assert scored["compute_score"].rewards == scored["megarl_score"].rewards == [0.5, 0.0, 6.0]


def test_a_relative_path_and_verl_names_without_the_rest(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    reward = build_reward(RewardConfig(name="my_reward.py:keyword_names", isolation="process"))
    assert score(SAMPLES[:2], reward, timeout_s=30).rewards == [0.0, 0.0]  # " 72" is not "72" unstripped
    assert score([dict(SAMPLES[0], response="72")], reward, timeout_s=30).rewards == [1.0]


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_dict_return_counts_its_score(reward_file, isolation):
    reward = build_reward(RewardConfig(name=f"{reward_file}:as_dict", isolation=isolation))
    assert score([dict(SAMPLES[0], response="72"), SAMPLES[1]], reward, timeout_s=30).rewards == [1.0, 0.0]
    without = score(SAMPLES[:1], build_reward(RewardConfig(name=f"{reward_file}:no_score", isolation=isolation)),
                    timeout_s=30)
    assert without.failed == 1 and "dict without 'score' (keys: acc)" in str(without.failures[0].error)


def config(name, *overrides):
    return tiny_config([f"reward.name={name}", "data.task=prompts.parquet", *overrides])


ROW = {"prompt": [{"role": "user", "content": "6 x 12?"}], "data_source": "openai/gsm8k",
       "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}}


def test_check_reward_describes_and_calls_the_function_once(reward_file):
    line = check_reward(config(f"{reward_file}:compute_score"), dict(ROW, extra_info={"weight": 1.0}))
    assert line == f"reward: compute_score from {reward_file} (verl signature)"
    assert check_reward(config("gsm8k"), ROW) == "reward: gsm8k (megarl signature)"
    assert check_reward(config(f"{reward_file}:megarl_score"), None) == \
        f"reward: megarl_score from {reward_file} (megarl signature)"


EXPECTED = ("; expected verl's compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) or "
            "megarl's fn(response, answer, sample)")


@pytest.mark.parametrize("name, message", [
    ("{dir}/missing.py:compute_score", "reward file not found: {dir}/missing.py"),
    ("{file}:nothing", "reward '{file}:nothing': {file} has no attribute 'nothing'"),
    ("{file}:two_args", "two_args(response, answer) cannot be called as megarl's convention (too many positional "
                        "arguments)" + EXPECTED),
    ("{file}:keyword_only", "keyword_only(response, answer, sample, *, scale) cannot be called as megarl's convention "
                            "(missing a required argument: 'scale')" + EXPECTED),
    ("{file}:needs_more", "needs_more(data_source, solution_str, ground_truth, extra_info, tokenizer) cannot be called "
                          "as verl's convention (missing a required argument: 'tokenizer')" + EXPECTED),
])
def test_load_errors_name_the_key_the_file_and_the_function(reward_file, name, message):
    name = name.format(dir=reward_file.parent, file=reward_file)
    message = message.format(dir=reward_file.parent, file=reward_file)
    with pytest.raises(ConfigError) as checked:
        check_reward(config(name), ROW, key="custom_reward_function.path")
    assert str(checked.value) == f"custom_reward_function.path={name!r}: {message}"
    with pytest.raises(ConfigError) as built:
        build_reward(RewardConfig(name=name))
    assert str(built.value) == f"reward.name={name!r}: {message}"


def test_an_import_error_names_its_file_and_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import math\n\nfrom no_such_module_xyz import thing\n")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def compute_score(:\n")
    with pytest.raises(ConfigError) as error:
        check_reward(config(f"{broken}:f"), ROW, key="custom_reward_function.path")
    assert str(error.value) == (f"custom_reward_function.path='{broken}:f': reward file {broken} does not import: "
                                "ModuleNotFoundError: No module named 'no_such_module_xyz' (line 3)")
    with pytest.raises(ConfigError) as error:
        check_reward(config(f"{syntax}:compute_score"), ROW)
    assert str(error.value).startswith(f"reward.name='{syntax}:compute_score': reward file {syntax} does not import: "
                                       "SyntaxError: ") and str(error.value).endswith("(line 1)")


def test_a_call_that_raises_on_the_first_row_is_named(reward_file):
    with pytest.raises(ConfigError) as error:
        check_reward(config(f"{reward_file}:raises_on_empty"), ROW)
    line = REWARDS_PY.splitlines().index("    return 1.0 / len(solution_str)") + 1
    assert str(error.value) == (f"reward.name='{reward_file}:raises_on_empty': the call on prompts.parquet, the first "
                                "row with an empty response failed: ZeroDivisionError: float division by zero (at "
                                f"{reward_file}:{line} in raises_on_empty)")


def test_builders_are_described_not_called():
    remote = config("remote", "reward.remote_url=http://127.0.0.1:9/score")
    assert check_reward(remote, ROW) == ("reward: remote, a JSON POST per sample to http://127.0.0.1:9/score (10 s a "
                                         "request, 3 retries; not called by the check)")
    code = config("code")
    assert check_reward(code, dict(ROW, reward_model={"ground_truth": '{"inputs": ["1"], "outputs": ["1"]}'})) \
        .startswith("reward: code, the response's program against the row's tests in the sandbox")
    with pytest.raises(ConfigError, match="reward.name='code': prompts.parquet, the first row: code reference must "
                                          "be a JSON object, got int"):
        check_reward(code, ROW)
