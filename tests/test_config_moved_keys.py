"""megarl's former key names (megarl/config/moved_keys.py): each still sets the key it moved to, said once by name;
one source giving an option under both names with different values is refused naming both."""

import pytest

from megarl.config import ConfigError, all_keys
from megarl.config.moved_keys import MOVED_KEYS
from megarl.config.tiny import TINY_ARGS, tiny_config
from megarl.train import main

NOTE = "algorithm.gspo_clip_eps is now algorithm.gspo.clip_eps (the former name is read for one more release)"


def test_every_former_key_moved_to_a_current_key_and_is_no_key_itself():
    keys = set(all_keys())
    assert set(MOVED_KEYS.values()) <= keys
    assert not set(MOVED_KEYS) & keys


def test_a_former_key_on_the_command_line_sets_the_new_one_and_says_so(tmp_path):
    cfg = tiny_config(["algorithm.gspo_clip_eps=1e-4", "algorithm.clip_ratio_c=4", "algorithm.otb_zero_tail=false",
                       "algorithm.critic_warmup_steps=0", "algorithm.overlong_buffer_len=4"])
    a = cfg.algorithm
    assert (a.gspo.clip_eps, a.dual_clip.clip_ratio_c, a.otb.zero_tail, a.overlong_buffer.len) == (1e-4, 4.0, False, 4)
    assert NOTE in cfg.notes and len(cfg.notes) == 5


def test_a_former_key_in_a_recipe_and_on_the_command_line_is_said_once(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm:\n  gspo_clip_eps: 2.0e-4\n  sapo_tau_neg: 1.5\n")
    cfg = tiny_config(["algorithm.gspo_clip_eps=1e-4"], path=recipe)
    assert (cfg.algorithm.gspo.clip_eps, cfg.algorithm.sapo.tau_neg) == (1e-4, 1.5)  # the command line wins
    assert cfg.notes.count(NOTE) == 1 and len(cfg.notes) == 2


def test_the_note_is_printed_where_the_run_says_its_notes(capsys):
    assert main(["--check-config", *TINY_ARGS, "algorithm.gspo_clip_eps=1e-4"]) == 0
    assert capsys.readouterr().out.count(f"note: {NOTE}\n") == 1


def test_pf_ppo_given_a_value_is_the_method_and_given_a_mapping_the_section(tmp_path):
    cfg = tiny_config(["algorithm.pf_ppo=max_min", "algorithm.pf_ppo_scope=group"])
    assert (cfg.algorithm.pf_ppo.method, cfg.algorithm.pf_ppo.scope) == ("max_min", "group")
    assert "algorithm.pf_ppo is now algorithm.pf_ppo.method (the former name is read for one more release)" in cfg.notes
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm:\n  pf_ppo: pow\n")
    assert tiny_config([], path=recipe).algorithm.pf_ppo.method == "pow"
    recipe.write_text("algorithm:\n  pf_ppo: {method: pow, weight_pow: 3.0}\n")
    cfg = tiny_config([], path=recipe)
    assert (cfg.algorithm.pf_ppo.method, cfg.algorithm.pf_ppo.weight_pow, cfg.notes) == ("pow", 3.0, [])
    assert tiny_config(["algorithm.pf_ppo={method: max_random}"]).algorithm.pf_ppo.method == "max_random"


def test_both_names_with_different_values_in_one_source_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.gspo_clip_eps=0.0001 and algorithm.gspo.clip_eps=0.0002 set the "
                                          r"same option \(algorithm.gspo_clip_eps is now algorithm.gspo.clip_eps\); "
                                          r"keep one"):
        tiny_config(["algorithm.gspo_clip_eps=0.0001", "algorithm.gspo.clip_eps=0.0002"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm:\n  pf_ppo_replay: 2\n  pf_ppo: {method: pow, replay: 3}\n")
    with pytest.raises(ConfigError, match=r"algorithm.pf_ppo_replay=2 and algorithm.pf_ppo.replay=3 set the same "
                                          r"option"):
        tiny_config([], path=recipe)
    # the same value under both names, or each name in its own source, is no clash: the later source wins
    same = tiny_config(["algorithm.gspo_clip_eps=1e-4", "algorithm.gspo.clip_eps=1.0e-4"])
    assert same.algorithm.gspo.clip_eps == 1e-4
    recipe.write_text("algorithm:\n  gspo_clip_eps: 2.0e-4\n")
    assert tiny_config(["algorithm.gspo.clip_eps=1e-4"], path=recipe).algorithm.gspo.clip_eps == 1e-4


def test_an_error_about_a_former_key_names_the_key_the_user_typed():
    with pytest.raises(ConfigError, match=r"algorithm.gspo.clip_eps=-1.0: must be > 0 \(set by "
                                          r"algorithm.gspo_clip_eps=-1\)"):
        tiny_config(["algorithm.gspo_clip_eps=-1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.gspo_clip_ep'; did you mean "
                                          r"'algorithm.gspo.clip_eps'\?"):
        tiny_config(["algorithm.gspo_clip_ep=1e-4"])
