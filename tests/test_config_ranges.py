"""Every numeric config key declares its range on its field (megarl/config/fields.py) and one check refuses a value
outside it by name: hostile values (-1, 0, NaN, infinity, huge) are accepted only where they mean something."""

import pytest

from megarl.config import Config, ConfigError, help_text
from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.config.fields import leaves

NUMERIC = ("int", "float")
HUGE_INT, HUGE_FLOAT = "1000000000000", "1e12"
OK = None  # accepted
NOT_INT = "expects int, got '{value}'"  # YAML reads nan and inf as strings: an int key refuses them by their type

# key -> {value: OK or what the error says after "<key>=<value>: "} for -1, 0, nan, inf and a huge value
TABLE = {
    "actor.optim.clip_grad": {"-1": r"must be >= 0 \(0 = off\)", "0": OK, "nan": "must be a finite number >= 0",
                              "inf": "must be a finite number >= 0", HUGE_FLOAT: OK},
    "actor.optim.lr": {"-1": "must be >= 0", "0": OK, "nan": "must be a finite number >= 0",
                       "inf": "must be a finite number", HUGE_FLOAT: OK},
    "actor.optim.adam_beta2": {"-1": r"must be in \[0, 1\)", "0": OK, "nan": "must be a finite number",
                               "inf": "must be a finite number", HUGE_FLOAT: r"must be in \[0, 1\)"},
    "algorithm.kl_coef": {"-1": r"must be >= 0 \(0 = no reference model\)", "0": OK,
                          "nan": "must be a finite number >= 0", "inf": "must be a finite number", HUGE_FLOAT: OK},
    "algorithm.clip_eps": {"-1": "must be > 0", "0": "must be > 0", "nan": "must be a finite number > 0",
                           "inf": "must be a finite number", HUGE_FLOAT: OK},
    "algorithm.gamma": {"-1": r"must be in \[0, 1\]", "0": OK, "nan": "must be a finite number",
                        "inf": "must be a finite number", HUGE_FLOAT: r"must be in \[0, 1\]"},
    "rollout.temperature": {"-1": r"must be >= 0 \(0 = greedy\)", "0": OK, "nan": "must be a finite number >= 0",
                            "inf": "must be a finite number", HUGE_FLOAT: OK},
    "rollout.top_p": {"-1": r"must be in \(0, 1\]", "0": r"must be in \(0, 1\]", "nan": "must be a finite number",
                      "inf": "must be a finite number", HUGE_FLOAT: r"must be in \(0, 1\]"},
    "rollout.top_k": {"-1": OK, "0": r"must be >= 1 or -1 \(-1 = all", "nan": NOT_INT, "inf": NOT_INT,
                      HUGE_INT: OK},
    "rollout.n_samples": {"-1": r"must be in \[1, 1000000\]", "0": r"must be in \[1, 1000000\]", "nan": NOT_INT,
                          "inf": NOT_INT, HUGE_INT: r"must be in \[1, 1000000\] \(the bound against typos"},
    "rollout.max_new_tokens": {"-1": "must be in", "0": r"must be in \[1, 10000000\]", "nan": NOT_INT,
                               "inf": NOT_INT, HUGE_INT: "must be in .* beyond any model's context"},
    "data.prompts_per_step": {"-1": "must be in", "0": r"must be in \[1, 1000000\]", "nan": NOT_INT,
                              "inf": NOT_INT, HUGE_INT: "must be in .*the bound against typos"},
    "actor.micro_batch_size": {"-1": "must be in", "0": r"must be in \[1, 1000000\]", "nan": NOT_INT,
                               "inf": NOT_INT, HUGE_INT: "must be in .*the bound against typos"},
    "actor.mini_batch_size": {"-1": r"must be in \[0, 1000000\] \(0 = the whole step's batch in one update\)",
                              "0": OK, "nan": NOT_INT, "inf": NOT_INT, HUGE_INT: "must be in"},
    "actor.ppo_epochs": {"-1": "must be in", "0": r"must be in \[1, 1000\]", "nan": NOT_INT, "inf": NOT_INT,
                         HUGE_INT: r"must be in \[1, 1000\] \(.*a whole pass"},
    "trainer.steps": {"-1": r"must be >= 0 \(0 = one pass over data.task's prompt file",
                      "0": "one pass over data.task's prompt file, and data.task='reverse' is a built-in task",
                      "nan": NOT_INT, "inf": NOT_INT, HUGE_INT: OK},
    "trainer.eval_every": {"-1": r"must be >= 0 \(0 = before RL and after the last step only\)", "0": OK,
                           "nan": NOT_INT, "inf": NOT_INT, HUGE_INT: OK},
    "trainer.seed": {"-1": r"must be in \[0, 4294967295\]", "0": OK, "nan": NOT_INT, "inf": NOT_INT,
                     HUGE_INT: r"must be in \[0, 4294967295\]"},
    "trainer.worker_timeout_s": {"-1": r"must be in \[0, 10000000\] \(0 = wait forever\)", "0": OK,
                                 "nan": r"must be a finite number in \[0, 10000000\] \(0 = wait forever\)",
                                 "inf": r"must be a finite number .*\(0 = wait forever\)",
                                 HUGE_FLOAT: "must be in .* Python's waits overflow"},
    "reward.timeout_s": {"-1": r"must be in .* \(0 = no limit\)", "0": OK, "nan": "must be a finite number",
                         "inf": r"must be a finite number .*\(0 = no limit\)", HUGE_FLOAT: "must be in"},
    "reward.max_failure_rate": {"-1": r"must be in \[0, 1\]", "0": OK, "nan": "must be a finite number",
                                "inf": "must be a finite number", HUGE_FLOAT: r"must be in \[0, 1\]"},
    "rollout.sglang_mem_fraction": {"-1": r"must be in \(0, 1\)", "0": r"must be in \(0, 1\)",
                                    "nan": "must be a finite number", "inf": "must be a finite number",
                                    HUGE_FLOAT: r"must be in \(0, 1\)"},
    "algorithm.gae.critic_lam": {"-1": OK, "0": OK, "nan": "must be a finite number in", "inf": "must be a finite",
                                 HUGE_FLOAT: r"must be in \[0, 1\] or -1 \(-1 = algorithm.lam, the policy's\)"},
}
# keys that only apply beside another setting
CONTEXT = {"algorithm.gae.critic_lam": ["algorithm.advantage=gae"]}
CASES = [(key, value, expected) for key, row in TABLE.items() for value, expected in row.items()]


@pytest.mark.parametrize("key, value, expected", CASES, ids=[f"{k}={v}" for k, v, _ in CASES])
def test_hostile_values_are_accepted_or_refused_by_name(key, value, expected):
    overrides = CONTEXT.get(key, []) + [f"{key}={value}"]
    if expected is OK:
        tiny_config(overrides)
        return
    if expected == NOT_INT:
        expected = rf"config key '{key}' {NOT_INT.format(value=value)}"
    else:
        shown = {"-1": r"-1(\.0)?", "0": r"0(\.0)?", HUGE_FLOAT: r"1000000000000\.0"}.get(value, value)
        expected = rf"{key}={shown}: {expected}"
    with pytest.raises(ConfigError, match=f"^{expected}"):
        tiny_config(overrides)


def _numeric_leaves():
    return [(key, f) for key, f, _ in leaves(Config()) if f.type in NUMERIC]


def test_every_numeric_field_declares_its_range():
    undeclared = [key for key, f in _numeric_leaves() if "range" not in f.metadata]
    assert not undeclared, f"numeric config keys without a range (opt's min/max/also, or unbounded=True): {undeclared}"
    assert len(_numeric_leaves()) > 150  # every section is walked: the training roles' parallel and optim too


@pytest.mark.parametrize("value", ["nan", "-.inf", ".inf"])
def test_no_float_field_takes_nan_or_an_infinity(value):
    floats = [key for key, f in _numeric_leaves() if f.type == "float"]
    assert len(floats) > 60
    for key in floats:
        with pytest.raises(ConfigError, match=rf"^{key}=-?(nan|inf): must be (a|any) finite number"):
            tiny_config(CONTEXT.get(key, []) + [f"{key}={value}"])


def test_a_product_of_keys_past_the_bound_is_named():
    with pytest.raises(ConfigError, match=r"data.prompts_per_step \* rollout.n_samples = 8 \* 500000 = 4000000 "
                                          r"sequences a step: must be at most 1000000"):
        tiny_config(["rollout.n_samples=500000"])


def test_check_config_refuses_a_hostile_value_in_one_line(capsys):
    from megarl.train import main

    assert main(["--check-config", *TINY_ARGS, "actor.optim.clip_grad=nan"]) == 2
    assert capsys.readouterr().err == "config error: actor.optim.clip_grad=nan: must be a finite number >= 0 (0 = off)\n"


def test_help_shows_each_keys_range_or_choices_after_its_default():
    text = help_text()
    for line in ("rollout.top_p = 1.0  (in (0, 1])", "rollout.top_k = -1  (>= 1 or -1)",
                 "rollout.engine = 'auto'  (one of auto, hf, sglang)", "rollout.n_samples = 8  (in [1, 1000000])",
                 "reward_model.weight = 1.0  (any finite number)", "actor.optim.adam_beta1 = 0.9  (in [0, 1))",
                 "async.stale = 'drop'  (one of drop, regenerate)"):
        assert f"  {line}\n" in text, line
    for key, _ in _numeric_leaves():
        assert f"  {key} = " in text and text.split(f"  {key} = ", 1)[1].split("\n", 1)[0].endswith(")"), key
