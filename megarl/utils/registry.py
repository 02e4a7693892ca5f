"""Name -> function registries for what users extend (advantage estimators, policy losses, rewards, tools).

A plugin is a plain function. It is either registered under a name with the `register` decorator,
or referred to directly as `package.module:function` (imported on first use), so users extend
megarl without editing it.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError):
    """A name that is neither registered nor a `module:function` path."""

    def __str__(self) -> str:  # KeyError would print the message quoted, as a repr
        return str(self.args[0])


class Registry:
    def __init__(self, kind: str):
        self.kind = kind  # what an entry is, for error messages: "advantage estimator", "reward", ...
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@ADVANTAGES.register("grpo")`. Registering a taken name is an error."""
        def add(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} '{name}' is already registered "
                                 f"({_qualname(self._entries[name])})")
            self._entries[name] = fn
            return fn
        return add

    def get(self, name: str) -> Callable:
        """A registered name, or a `module:function` path."""
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            return _load(name, self.kind)
        close = difflib.get_close_matches(name, self.names(), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        valid = ", ".join(self.names()) or "(none)"
        raise UnknownNameError(f"unknown {self.kind} '{name}'; {hint}valid names: {valid}, "
                               f"or a 'package.module:function' path")

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _load(path: str, kind: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{kind} path '{path}' must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{kind} '{path}': cannot import module '{module_name}': {e}") from e
    fn = module
    for part in attr.split("."):  # allows module:Class.method
        if not hasattr(fn, part):
            raise AttributeError(f"{kind} '{path}': '{module_name}' has no attribute '{attr}'")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{kind} '{path}' is a {type(fn).__name__}, not a function")
    return fn


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
