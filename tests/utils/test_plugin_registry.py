import pytest

from megarl.algorithms import ADVANTAGES, POLICY_LOSSES
from megarl.utils.registry import Registry, UnknownNameError


def make_registry():
    reg = Registry("reward")

    @reg.register("gsm8k")
    def gsm8k():
        return "gsm8k"

    @reg.register("countdown")
    def countdown():
        return "countdown"

    return reg


def test_register_and_get():
    reg = make_registry()
    assert reg.get("gsm8k")() == "gsm8k"
    assert reg.names() == ["countdown", "gsm8k"]
    assert "countdown" in reg and "math" not in reg


def test_typo_names_the_closest_match_and_the_valid_names():
    with pytest.raises(UnknownNameError) as err:
        make_registry().get("gsm8x")
    assert str(err.value) == ("unknown reward 'gsm8x'; did you mean 'gsm8k'? valid names: countdown, gsm8k, "
                              "or a 'package.module:function' path")
    with pytest.raises(KeyError, match="unknown advantage estimator 'gpro'; did you mean 'grpo'"):
        ADVANTAGES.get("gpro")
    with pytest.raises(KeyError, match="unknown policy loss 'zzz'; valid names: .*dual_clip, .*gspo, .*ppo_clip"):
        POLICY_LOSSES.get("zzz")


def test_module_function_path_loads_a_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(x):\n    return x * 2\n"
        "class Scorer:\n    @staticmethod\n    def score(x):\n        return x + 1\n"
        "THRESHOLD = 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = make_registry()
    assert reg.get("my_rewards:exact")(21) == 42
    assert reg.get("my_rewards:Scorer.score")(1) == 2
    with pytest.raises(AttributeError, match="'my_rewards' has no attribute 'missing'"):
        reg.get("my_rewards:missing")
    with pytest.raises(TypeError, match="is a float, not a function"):
        reg.get("my_rewards:THRESHOLD")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module_xyz'"):
        reg.get("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        reg.get("my_rewards:")


def test_a_name_cannot_be_registered_twice():
    reg = make_registry()
    with pytest.raises(ValueError, match="reward 'gsm8k' is already registered"):
        reg.register("gsm8k")(lambda: None)
