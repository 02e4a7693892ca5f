"""Commands in verl's vocabulary: which keys are verl's, and the megarl keys they become (megarl/config/verl_keys.py).

A command (a recipe's keys, then the command line's) is read in verl's vocabulary as soon as one of its keys is
verl's alone (`actor_rollout_ref.*`, `data.train_files`, `trainer.total_epochs`, ...). Then verl's defaults
apply to every verl key it does not set, so the command trains what verl would train with it; megarl's own
keys may sit beside verl's and win over what verl's defaults would give. A megarl key and a verl key of the
same source that set one option to two values are an error; so is every unknown key, all named in one message.
megarl's own former key names (megarl/config/moved_keys.py) are read as the keys they are now, each said once.

`plan(sources, megarl_keys)` returns the assignments to make, in order, with the profile and the notes the run
prints (verl keys that have no effect in megarl, engines replaced).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.moved_keys import MOVED_KEYS, moved_note, moved_to
from megarl.config.sections import TRAINING_ROLES
from megarl.config.validation import ConfigError
from megarl.config.verl_conversions import _rows
from megarl.config.verl_keys import (BY_KEY, MISSING, REFUSED_SECTIONS, VERL_KEYS, VERL_SECTIONS, Refusal,
                                     has_no_effect)

# settings of the verl profile that no single verl key carries: verl renders every prompt with the chat template
VERL_FIXED = {"data.chat_template": True}


@dataclass
class Plan:
    profile: str  # "megarl" or "verl"
    assignments: list[tuple[str, Any]] = field(default_factory=list)  # (megarl key, value), applied in order
    given: set[str] = field(default_factory=set)  # megarl keys the command set, itself or through a verl key
    notes: list[str] = field(default_factory=list)  # said at start-up
    origins: dict[str, str] = field(default_factory=dict)  # megarl key -> the key the user typed and its value
    errors: list[str] = field(default_factory=list)


def strip_hydra(key: str) -> str:
    """Hydra's `+key` / `++key` (add or force a key) name the same key here."""
    return key.lstrip("+")


def is_verl_key(key: str) -> bool:
    return key in BY_KEY or key.split(".", 1)[0] in VERL_SECTIONS


def count_rows(path: str) -> int | None:
    """Rows of a prompt file (parquet from its footer; jsonl by non-blank lines), None when it is not there."""
    file = Path(path)
    if not file.is_file():
        return None
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(file).num_rows
        if file.suffix == ".jsonl":
            with file.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if file.suffix == ".json":
            data = json.loads(file.read_text())
            return len(data) if isinstance(data, list) else 1
    except (OSError, ValueError):
        return None  # unreadable: the prompt loader names the file and what is wrong with it
    return None


class VerlValues:
    """The command's verl keys (the user's values over verl's defaults), as conversions read them."""

    def __init__(self, given: dict[str, Any], megarl: dict[str, Any], verl_defaults: bool = True):
        self.given, self.megarl, self.verl_defaults = given, megarl, verl_defaults

    def get(self, key: str):
        """The command's value; else verl's default, or beside a megarl recipe the megarl option the key names."""
        if key in self.given:
            return self.given[key]
        target = getattr(BY_KEY[key].convert, "target", None)
        if not self.verl_defaults and target in self.megarl:
            return self.megarl[target]
        default = BY_KEY[key].default
        return None if default is MISSING else default

    def rows(self, key: str) -> int:
        """The positive count the verl key `key` holds; a Refusal naming that key otherwise."""
        try:
            return _rows(self.get(key))
        except Refusal as e:
            raise Refusal(str(e), key) from None

    def get_megarl(self, key: str):
        return self.megarl[key]

    @staticmethod
    def path(value) -> str:
        return os.path.expanduser(str(value))

    def train_rows(self) -> int | None:
        return count_rows(self.path(self._one("data.train_files")))

    def val_rows(self) -> int | None:
        return count_rows(self.path(self._one("data.val_files")))

    def _one(self, key: str) -> str:
        value = self.get(key)
        return value[0] if isinstance(value, list) and len(value) == 1 else str(value)


# verl's own trainer configs (verl/trainer/config/*.yaml): the defaults a command of verl's keys gets here
VERL_CONFIG_NAMES = ("ppo_trainer", "ppo_megatron_trainer")


def hydra_config_flags(name: str | None, path: str | None, profile: str) -> str | None:
    """verl's Hydra flags `--config-name` / `--config-path`: verl's own trainer configs are the defaults megarl
    applies to a command of verl's keys (`profile` "verl") anyway: a note says so (None when neither flag is given).
    A config file of the user's or a recipe's is not read here, and is refused with what to do instead."""
    if name is None and path is None:
        return None
    if name is not None and name.removesuffix(".yaml") in VERL_CONFIG_NAMES:
        if profile != "verl":
            raise ConfigError(f"--config-name={name}: verl's defaults apply to a command of verl's keys, and this "
                              "command's keys are megarl's: leave the flag out")
        return (f"--config-name={name}: verl's own defaults, which megarl applies to every verl key the command does "
                "not set (it trains with Megatron either way)")
    flag = f"--config-name={name}" if name is not None else f"--config-path={path}"
    raise ConfigError(f"{flag}: megarl does not read Hydra config files; give their keys on the command line as "
                      f"key=value (verl's keys, over verl's defaults), or a megarl recipe with --config <file.yaml>")


def interpolation_problem(value) -> str | None:
    """A Hydra interpolation (`${trainer.project_name}_x`) would be taken as it is written: a directory named so."""
    if isinstance(value, str) and "${" in value:
        return "megarl does not resolve Hydra's ${...} interpolations; write the value itself"
    return None


def type_problem(default, value) -> str | None:
    """What is wrong with a verl key's value of another type than verl's default (a switch given `yes_please`, a
    count given 2.5, a rate given `fast`), or None. Python's bool() and truthiness would read any string as on, so a
    switch takes only true/false (or 0/1, as verl's truthiness reads them). A rate may come as the string YAML
    leaves `1e-6`; null is left to the key's conversion."""
    if value is None or default is None or default is MISSING:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) or value in (0, 1) else "expected true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    if isinstance(default, float) and isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return "expected a number"
        return None
    if isinstance(default, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "expected a number"
    return None


def with_origins(message: str, origins: dict[str, str]) -> str:
    """A config error about options that a verl key or a former megarl key set, with the key that set each (the
    user typed that one)."""
    named = [typed for key, typed in origins.items() if re.search(rf"(?<![\w.]){re.escape(key)}=", message)]
    return message + (f" (set by {'; '.join(named)})" if named else "")


def near_miss(key: str, candidates) -> str | None:
    """The candidate `key` is a typo of, or None: a close name under the same section, or the same name under a
    close section. Names that merely share letters (use_kl_loss, ignore_eos) are not offered."""
    parent, _, leaf = key.rpartition(".")
    best, score = None, 0.0
    for candidate in candidates:
        c_parent, _, c_leaf = candidate.rpartition(".")
        if c_parent == parent:
            s = difflib.SequenceMatcher(None, leaf, c_leaf).ratio()
            s = s if s >= 0.8 else 0.0
        elif c_leaf == leaf:
            s = difflib.SequenceMatcher(None, parent, c_parent).ratio()
            s = s if s >= 0.85 else 0.0
        else:
            s = 0.0
        if s > score:
            best, score = candidate, s
    return best


def unknown_key(key: str, megarl_keys: list[str], verl_command: bool = False) -> str:
    """The error line of an unknown key: the verl key it may stand for (and what that becomes), or a near miss; in a
    command in verl's vocabulary (`verl_command`) a near miss among verl's keys first (critic.ppo_mini_batch_sise is
    verl's critic.ppo_mini_batch_size, in prompts, before megarl's critic.mini_batch_size, in sequences)."""
    if key.split(".", 1)[0] in REFUSED_SECTIONS:
        return f"{key}: {REFUSED_SECTIONS[key.split('.', 1)[0]]}"
    misplaced = _other_roles_key(key, megarl_keys)
    if misplaced:
        return misplaced
    if key.split(".", 1)[0] in VERL_SECTIONS or key in BY_KEY:
        close = near_miss(key, BY_KEY)
        hint = f"; did you mean '{close}'?" if close else ""
        return f"verl key '{key}' is not one megarl reads (docs/migrating-from-verl.md lists those it does){hint}"
    leaf = key.rpartition(".")[2]
    verl_rows = [row for row in VERL_KEYS if row.key.rpartition(".")[2] == leaf and row.sets]
    verl_close = near_miss(key, BY_KEY)
    close = ((verl_command and verl_close) or near_miss(key, megarl_keys) or MOVED_KEYS.get(near_miss(key, MOVED_KEYS))
             or verl_close)
    if close:
        return f"unknown config key '{key}'; did you mean '{close}'?"
    if verl_rows:
        row = verl_rows[0]
        return f"unknown config key '{key}'; verl's '{row.key}' sets {row.sets} ({row.note})"
    section = key.split(".", 1)[0]
    known = sorted({k.split(".", 1)[0] for k in megarl_keys})
    where = "" if section in known else f" (sections: {', '.join(known)}; verl's: {', '.join(VERL_SECTIONS)})"
    return f"unknown config key '{key}'{where}"


def _other_roles_key(key: str, megarl_keys: list[str]) -> str:
    """The error line of a key of a training role's section that only other roles have (reward_model.ppo_epochs),
    or a typo of one (reward_model.ppo_epoch), naming the roles it applies to; else ''."""
    role, _, rest = key.partition(".")
    if role not in TRAINING_ROLES:
        return ""
    others = [other for other in TRAINING_ROLES if other != role]
    owners = [other for other in others if f"{other}.{rest}" in megarl_keys]
    if owners:
        return (f"config key '{key}' does not apply to {role}: {rest} is a key of {' and '.join(owners)} only "
                f"({', '.join(f'{owner}.{rest}' for owner in owners)})")
    if near_miss(key, megarl_keys):  # a typo of the role's own key: unknown_key names that one
        return ""
    for other in others:
        close = near_miss(f"{other}.{rest}", [k for k in megarl_keys if k.startswith(other + ".")])
        if close:
            meant = close.partition(".")[2]
            owners = [o for o in others if f"{o}.{meant}" in megarl_keys]
            return (f"unknown config key '{key}'; did you mean {meant}? It is a key of {' and '.join(owners)} only "
                    f"({', '.join(f'{owner}.{meant}' for owner in owners)}), not of {role}")
    return ""


def plan(sources: list[tuple[str, dict[str, Any]]], megarl_keys: list[str], megarl_defaults: dict[str, Any]) -> Plan:
    """The assignments of a command given as (source name, {dotted key: value}) in order of precedence (a recipe,
    then the command line). Keys that name a section (`actor.parallel={tp: 2}`) are megarl's."""
    megarl_names = set(megarl_keys) | {k.rsplit(".", 1)[0] for k in megarl_keys if "." in k}
    keys = [(tier, strip_hydra(k), k, v) for tier, (_, items) in enumerate(sources) for k, v in items.items()]
    keys, moved_notes, errors, moved_origins = _read_moved(keys)
    # verl's vocabulary is on when a key is verl's alone; a key spelled the same in both is then read as verl's
    verl_on = any(is_verl_key(key) and key not in megarl_names for _, key, _, _ in keys)
    verl_given: dict[str, Any] = {}  # later sources win
    verl_tier: dict[str, int] = {}
    megarl_given: list[tuple[int, str, Any]] = []
    for tier, key, raw_key, value in keys:
        if key.startswith("~"):
            errors.append(f"{raw_key}: megarl has no key deletion; leave the key out")
        elif verl_on and key in BY_KEY:
            verl_given[key], verl_tier[key] = value, tier
        elif key in megarl_names:
            megarl_given.append((tier, key, value))
        else:
            errors.append(unknown_key(key, megarl_keys, verl_on))
    for key, value in list(verl_given.items()):
        if problem := interpolation_problem(value) or type_problem(BY_KEY[key].default, value):
            errors.append(f"{key}={value!r}: {problem}")
            del verl_given[key]  # the conversions that read it see verl's default: one error, not one per reader
    # verl's defaults apply to a command in verl's vocabulary; beside a recipe of megarl's keys, verl's keys are
    # read as the megarl options they name and the recipe keeps the rest
    recipe_is_megarl = any(tier < len(sources) - 1 for tier, _, _ in megarl_given)
    verl_defaults = verl_on and not recipe_is_megarl
    result = Plan("verl" if verl_defaults else "megarl", errors=errors, given={key for _, key, _ in megarl_given},
                  notes=moved_notes, origins=moved_origins)
    if not verl_on:
        result.assignments = [(key, value) for _, key, value in megarl_given]
        return result

    # megarl's values as the conversions read them (trainer.steps for a warmup ratio, the world size for a global
    # micro-batch): the defaults, a first pass of the conversions, the megarl keys given
    explicit = {key: value for _, key, value in megarl_given}
    converted: dict[str, tuple[Any, int, str]] = {}  # megarl key -> (value, source tier (-1: a default), verl key)
    for _ in range(2):
        values = VerlValues(verl_given, dict(megarl_defaults) | {k: v for k, (v, _, _) in converted.items()}
                            | explicit, verl_defaults)
        converted, notes, refusals = {}, [], []
        for row in VERL_KEYS:
            given = row.key in verl_given
            if not given and (row.default is MISSING or not verl_defaults):
                continue
            value = values.get(row.key)
            try:
                out = row.convert(value, values)
            except (Refusal, ValueError, TypeError) as e:  # a value of a type the conversion cannot read
                key = getattr(e, "key", None) or row.key
                refusals.append(f"{key}={values.get(key)!r}: {e}")
                continue
            tier = verl_tier.get(row.key, -1)
            for key, v in out.items():
                if key not in converted or converted[key][1] <= tier:  # a key the command set beats a default
                    converted[key] = (v, tier, row.key)
            if given and has_no_effect(row):
                notes.append(f"{row.key}={value!r}: no effect ({row.note})")
            elif given and (differs := getattr(row.convert, "differs", None)) and (note := differs(value)):
                notes.append(f"{row.key}={value!r}: {note}")
    for key, value in VERL_FIXED.items() if verl_defaults else ():
        converted.setdefault(key, (value, -1, "verl's vocabulary"))
    if verl_given.get("actor_rollout_ref.rollout.name") == "vllm" and "rollout.engine" in converted:
        engine = converted["rollout.engine"][0]
        served = "megarl serves rollouts with SGLang" if engine == "sglang" else "megarl generates with transformers"
        notes.append(f"actor_rollout_ref.rollout.name='vllm': {served}, with the same sampling settings "
                     f"(rollout.engine={engine})")
    if verl_defaults and "trainer.steps" not in converted and "trainer.steps" not in explicit:
        notes.append(f"trainer.total_epochs: data.train_files={values.get('data.train_files')!r} is not there to "
                     "count its prompts; trainer.steps is counted once it exists")
    for tier, key, value in megarl_given:  # a megarl key and a verl key of one source setting one option
        if key in converted:
            v, t, verl_key = converted[key]
            if t == tier and v != value:
                errors.append(f"{key}={value!r} and {verl_key}={verl_given[verl_key]!r} set the same option "
                              f"({key}={v!r}); keep one")
    result.notes, result.errors = moved_notes + notes, errors + list(dict.fromkeys(refusals))  # one per key at fault
    # in order of precedence: verl's defaults, then each source's verl keys and then its megarl keys
    ordered = sorted([(t, 0, key, v) for key, (v, t, _) in converted.items()]
                     + [(t, 1, key, v) for t, key, v in megarl_given], key=lambda a: (a[0], a[1]))
    result.assignments = [(key, v) for _, _, key, v in ordered]
    for key, (_, _, row) in converted.items():
        if key not in explicit and row in BY_KEY:
            row = _setter(key, row)
            default = ", verl's default" if row not in verl_given else ""
            result.origins[key] = f"verl's {row}={values.get(row)!r}{default}"
    result.given |= {key for key, (_, t, _) in converted.items() if t >= 0}
    return result


# megarl key -> the verl keys whose table row names it alone ("rollout.sglang_tp": the rollout's TP)
SETTERS: dict[str, list[str]] = {}
for _row in VERL_KEYS:
    SETTERS.setdefault(_row.sets, []).append(_row.key)


def _setter(key: str, row: str) -> str:
    """The verl key an error about megarl's `key` names, which the conversion of `row` set: the one verl key that is
    `key` in megarl where `row` sets it beside others (rollout.name sets sglang_tp from tensor_model_parallel_size)."""
    owners = SETTERS.get(key, [])
    return owners[0] if BY_KEY[row].sets != key and len(owners) == 1 else row


def _read_moved(keys: list[tuple[int, str, str, Any]]) -> tuple[list, list[str], list[str], dict[str, str]]:
    """The command's (tier, key, typed key, value) with megarl's former keys under their new names
    (megarl/config/moved_keys.py); a note for each former key read; the errors of a source that gives one option
    under both names with different values; {new key: the former key and value} for error messages."""
    given = {(tier, key): (typed, value) for tier, key, typed, value in keys}
    out, notes, errors, origins = [], {}, [], {}
    for tier, key, typed, value in keys:
        new = moved_to(key, value)
        if new is None:
            out.append((tier, key, typed, value))
            continue
        notes.setdefault(key, moved_note(key, new))
        if (tier, new) in given:  # the new name is read in its own place
            other_typed, other = given[(tier, new)]
            if not _same_value(other, value):
                errors.append(f"{typed}={value!r} and {other_typed}={other!r} set the same option ({key} is now "
                              f"{new}); keep one")
            continue
        out.append((tier, new, typed, value))
    for tier, key, typed, value in out:  # the last source to set a key gives its value
        origins.pop(key, None)
        if typed != key and MOVED_KEYS.get(strip_hydra(typed)) == key:
            origins[key] = f"{typed}={value!r}"
    return out, list(notes.values()), errors, origins


def _same_value(a, b) -> bool:
    """Equal, or the same number written two ways (YAML 1.1 reads 1e-4 as a string, 1.0e-4 as a number)."""
    try:
        return a == b or float(a) == float(b)
    except (TypeError, ValueError):
        return False
