"""A config field declared whole: its default, its help (`--help`) and the values it allows (`opt`), and the check of
a config against every field's declaration (`check_ranges`, the first of `Config.validate`'s checks).

A numeric field declares its range: `min` and `max`, each inclusive unless said exclusive, and `also` for a value
outside them that means "off" (rollout.top_k's -1); `unbounded` declares a number that may be anything finite. A
float never takes NaN or an infinity: a key that can mean "no limit" says so with 0. An upper bound past which a
value is a typo says what it protects (`why`, shown when it is crossed); the shared ones are the dicts below. A string
field with a fixed set of values declares its `choices`.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

from megarl.config.validation import ConfigError

# Upper bounds against typos, each saying what it protects: opt(8, "...", min=1, **SEQUENCES)
SEQUENCES = {"max": 1_000_000, "why": "the bound against typos: a step's tensors and generation are sized by it"}
TOKENS = {"max": 10_000_000, "why": "the bound against typos: beyond any model's context, and buffers are sized by it"}
SECONDS = {"max": 10_000_000, "why": "the bound against typos, about 4 months; past ~9e9 s Python's waits overflow"}
CLUSTER = {"max": 100_000, "why": "more than any cluster has: Ray would wait forever to place them"}
PASSES = {"max": 1000, "why": "the bound against typos: each is a whole pass of generation or training"}
MEBIBYTES = {"max": 1_048_576, "why": "1 TiB, more than any host or GPU has: it is allocated whole"}


@dataclass(frozen=True)
class Range:
    """The values a field allows."""
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    max_exclusive: bool = False
    also: tuple = ()
    why: str = ""
    choices: tuple = ()

    def describe(self) -> str:
        """The allowed values as a message and `--help` say them: '>= 0', 'in (0, 1]', '>= 1 or -1', 'one of ...'."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        lo, hi = _number(self.min), _number(self.max)
        if lo is not None and hi is not None:
            text = f"in {'(' if self.min_exclusive else '['}{lo}, {hi}{')' if self.max_exclusive else ']'}"
        elif lo is not None:
            text = f"{'>' if self.min_exclusive else '>='} {lo}"
        elif hi is not None:
            text = f"{'<' if self.max_exclusive else '<='} {hi}"
        else:
            text = "any finite number"
        return " or ".join([text, *map(_number, self.also)])

    def admits(self, value) -> bool:
        if self.choices:
            return value in self.choices
        if value in self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.min is not None and (value < self.min or (self.min_exclusive and value == self.min)):
            return False
        return self.max is None or (value < self.max or (not self.max_exclusive and value == self.max))

    def problem(self, key: str, value, help: str) -> str:
        """Why `value` is refused: the key, the value, what is allowed and, from the help or the bound, why."""
        nonfinite = isinstance(value, float) and not math.isfinite(value)
        allowed = self.describe()
        if nonfinite and (self.min is not None or self.max is not None):
            allowed = "a finite number " + allowed
        text = f"{key}={repr(value) if isinstance(value, str) else value}: must be {allowed}"
        if self.why and not nonfinite and self.max is not None and value > self.max:
            return f"{text} ({self.why})"
        meanings = [m for v in self.also + ((self.min,) if self.min is not None and not self.min_exclusive else ())
                    if (m := _meaning(help, _number(v)))]
        return f"{text} ({'; '.join(meanings)})" if meanings else text


def _number(value) -> str | None:
    """A bound as the messages write it: 1 for 1.0, 1e-08 as Python writes it."""
    if value is None:
        return None
    return str(int(value)) if float(value).is_integer() else str(value)


def _meaning(help: str, value: str) -> str:
    """What the help says `value` means ('0 = greedy' from '... (0 = greedy)'), up to its clause's end (a ';', a
    sentence's '. ' or the bracket around it); else ''."""
    found = re.search(rf"(?<![^\s(;,]){re.escape(value)} = ", help)
    if not found:
        return ""
    start, depth = found.start(), 0
    for end in range(found.end(), len(help)):
        depth += {"(": 1, ")": -1}.get(help[end], 0)
        if depth < 0 or (depth == 0 and (help[end] == ";" or help[end:end + 2] == ". ")):
            return help[start:end]
    return help[start:]


def opt(default, help: str, *, min: float | None = None, max: float | None = None, min_exclusive: bool = False,
        max_exclusive: bool = False, also: tuple = (), why: str = "", choices: tuple | None = None,
        unbounded: bool = False):
    """A config field with its help text (shown by `--help`) and the values it allows (see the module's docstring)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["range"] = Range(choices=tuple(choices))
    elif min is not None or max is not None or unbounded:
        metadata["range"] = Range(min, max, min_exclusive, max_exclusive, tuple(also), why)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls, help: str, **defaults):
    """A section of the config. `defaults` replace the section class's own where the whole config's differ (a
    sub-section's as a dict of its keys): a run's policy optimizer starts from a real run's learning rate, while an
    ActorConfig built alone (an engine in a test, megarl/convert.py) keeps the class's."""
    return field(default_factory=lambda: _with_defaults(cls(), defaults), metadata={"help": help})


def _with_defaults(obj, defaults: dict):
    for name, value in defaults.items():
        setattr(obj, name, _with_defaults(getattr(obj, name), value) if isinstance(value, dict) else value)
    return obj


def config_key(name: str) -> str:
    """A field's config key: its name, less the underscore a Python keyword needs as a name (async_ -> async)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def leaves(obj, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, object]]:
    """Every option of a config (or a section) as (dotted key, field, value)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = prefix + config_key(f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, key + ".")
        else:
            yield key, f, value


def check_ranges(cfg) -> None:
    """Every option against the values its field allows; the first refused one is a ConfigError that says why."""
    for key, f, value in leaves(cfg):
        allowed = f.metadata.get("range")
        if allowed is not None and not allowed.admits(value):
            raise ConfigError(allowed.problem(key, value, f.metadata["help"]))
