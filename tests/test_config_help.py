"""`--help`: the keys most runs set come first, each a real key shown with its default, then every key by section."""

import re

from megarl.config import all_keys, help_text
from megarl.config.loading import COMMON_KEYS


def keys_in(text: str) -> list[str]:
    return re.findall(r"^  (\S+) = ", text, flags=re.M)  # an option's line; its help is indented further


def test_help_shows_the_common_keys_first_and_then_every_key():
    text = help_text()
    first, rest = text.split("every key, by section:")
    assert set(COMMON_KEYS) <= set(all_keys()), set(COMMON_KEYS) - set(all_keys())
    assert keys_in(first) == list(COMMON_KEYS)
    assert sorted(keys_in(rest)) == sorted(all_keys())


def test_help_of_some_sections_shows_only_their_keys():
    text = help_text(("data",))
    keys = keys_in(text)
    assert keys and all(k.startswith("data.") for k in keys)
    assert keys[:3] == ["data.task", "data.val_task", "data.prompts_per_step"]  # the common ones of the section first
