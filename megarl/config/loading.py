"""Building a Config: defaults <- YAML recipe <- dotted `key=value` overrides, then validation; and the list
of every key with its default and help (`--help`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megarl.config.fields import config_key
from megarl.config.sections import Config
from megarl.config.validation import ConfigError
from megarl.config.verl import plan, unknown_key, with_origins


def _fields(obj) -> dict[str, dataclasses.Field]:
    """Fields by config key."""
    return {config_key(f.name): f for f in dataclasses.fields(obj)}


def all_keys(obj=None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config."""
    obj = obj if obj is not None else Config()
    keys = []
    for name, f in _fields(obj).items():
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _coerce(key: str, value: Any, annotation) -> Any:
    """Check (and gently convert) a value against a field's annotation."""
    hint = typing.get_type_hints(annotation[0])[annotation[1]] if isinstance(annotation, tuple) else annotation
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if value is None:
            return None
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif hint is list or typing.get_origin(hint) is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
    else:
        return value
    raise ConfigError(f"config key '{key}' expects {getattr(hint, '__name__', hint)}, got {value!r}")


def _set(cfg, key: str, value: Any) -> None:
    parts = key.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        names = _fields(obj)
        if part not in names:
            raise ConfigError(unknown_key(key, all_keys()))
        attr = names[part].name
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, attr)):
                if not isinstance(value, dict):
                    raise ConfigError(f"config key '{key}' is a section; set its keys, e.g. {key}.<name>=...")
                for sub, v in value.items():
                    _set(cfg, f"{key}.{sub}", v)
            else:
                setattr(obj, attr, _coerce(key, value, (type(obj), attr)))
        else:
            obj = getattr(obj, attr)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"config key '{'.'.join(parts[:i + 1])}' is not a section")


def _flatten(d: dict, leaves: set[str], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested mapping; a mapping that is a key's value (trainer.worker_env) stays whole."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in leaves:
            out.update(_flatten(v, leaves, f"{key}."))
        else:
            out[key] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Defaults <- YAML recipe <- `key=value` overrides, then validation. Keys may be megarl's or verl's
    (megarl/config/verl.py); every unknown key, refused verl setting and clash is named in one ConfigError.
    `base` ({dotted megarl key: value}) replaces defaults before the recipe is read (megarl/config/tiny.py).

    The config remembers how it was read: `profile` ("megarl" or "verl"), `given` (the megarl keys the command
    set, itself or through verl's keys) and `notes` (verl keys without effect here, said at start-up)."""
    cfg = Config()
    for key, value in (base or {}).items():
        _set(cfg, key, value)
    keys = all_keys()
    sources = []
    if path:
        path = Path(path)
        data = _read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections at the top level")
        sources.append((str(path), _flatten(data, set(keys))))
    command = {}
    for item in overrides:
        if item.startswith("~") and "=" not in item:  # Hydra's deletion, `~key`: plan() names it
            command[item.strip()] = None
            continue
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            command[key.strip()] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            split = raw.startswith(("[", "{")) and not raw.endswith(("]", "}"))
            hint = ("; did the shell split a list at a space? Quote the whole override or write it without spaces, "
                    f"{key}=[a,b]") if split else ""
            raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(e)}){hint}") from None
    sources.append(("command line", command))
    defaults = {key: _get(cfg, key) for key in keys}
    read = plan(sources, keys, defaults)
    errors = list(read.errors)
    for key, value in read.assignments:
        try:
            _set(cfg, key, value)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{len(errors)} problems in the command:\n" + "\n".join(f"  - {e}" for e in errors))
    cfg.profile, cfg.given, cfg.notes, cfg.origins = read.profile, read.given, read.notes, read.origins
    try:
        return cfg.validate()
    except ConfigError as e:
        raise ConfigError(with_origins(str(e), read.origins)) from None


def _get(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, _fields(obj)[part].name)
    return obj


def _read_yaml(path: Path):
    """The parsed recipe; a missing, unreadable or malformed file is a ConfigError naming it (and where in it)."""
    try:
        return yaml.safe_load(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        line, column = e.object.count(b"\n", 0, e.start) + 1, e.start - e.object.rfind(b"\n", 0, e.start)
        raise ConfigError(f"config file {path}: not valid UTF-8 (byte {e.object[e.start]:#04x} at line {line}, "
                          f"column {column})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {_yaml_problem(e)}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """YAML's own account of the error, with the 1-based line and column it reports."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return str(e).replace("\n", " ")
    context = f" ({e.context} at {at(e.context_mark)})" if e.context and e.context_mark else ""
    return f"{e.problem} at {at(e.problem_mark)}{context}"


# What most runs set, shown first by `--help` (the full list by section follows)
COMMON_KEYS = ("model.path", "data.task", "data.val_task", "data.prompts_per_step", "data.max_prompt_length",
               "rollout.n_samples", "rollout.max_new_tokens", "rollout.temperature", "reward.name",
               "algorithm.advantage", "algorithm.policy_loss", "algorithm.kl_coef", "actor.optim.lr",
               "actor.mini_batch_size", "actor.parallel.world_size", "actor.parallel.tp", "trainer.steps",
               "trainer.eval_every", "trainer.save_every", "trainer.output_dir")


def help_text(sections: tuple[str, ...] = (), common: tuple[str, ...] = COMMON_KEYS) -> str:
    """Every option with its default, the values it allows and its help, for `--help`: `common` first, then all by
    section; only those of the named top-level sections if any."""
    entries, lines = {}, []

    def walk(obj, prefix):
        for name, f in _fields(obj).items():
            if sections and not prefix and name not in sections:
                continue
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                lines.append(f"\n[{prefix}{name}]  {f.metadata.get('help', '')}")
                walk(value, f"{prefix}{name}.")
            else:
                allowed = f.metadata.get("range")
                shown = f"  {prefix}{name} = {value!r}" + (f"  ({allowed.describe()})" if allowed else "")
                entries[prefix + name] = f"{shown}\n      {f.metadata.get('help', '')}"
                lines.append(entries[prefix + name])

    walk(Config(), "")
    first = [entries[key] for key in common if key in entries]
    if not first:
        return "\n".join(lines)
    return "\n".join([f"\n[most runs set]  the {len(first)} keys most runs change; every key by section below",
                      *first, "", "every key, by section:", *lines])
