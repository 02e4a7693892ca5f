"""Name -> function registries for what users extend (advantage estimators, policy losses, rewards, tools).

A plugin is a plain function. It is either registered under a name with the `register` decorator,
or referred to directly as `package.module:function` (imported on first use) or `/path/to/file.py:function`
(the file imported by its path, a relative path from the working directory), so users extend megarl
without editing it.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
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
        """A registered name, a `module:function` path or a `file.py:function` path."""
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
    module_name, _, attr = path.rpartition(":")
    if module_name.endswith(".py") and attr:
        return FileFunction(module_name, attr, kind)
    if not module_name or not attr:
        raise ValueError(f"{kind} path '{path}' must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{kind} '{path}': cannot import module '{module_name}': {e}") from e
    return _attribute(module, attr, f"{kind} '{path}'", f"'{module_name}'")


def _attribute(module: ModuleType, attr: str, what: str, where: str) -> Callable:
    fn = module
    for part in attr.split("."):  # allows module:Class.method
        if not hasattr(fn, part):
            raise AttributeError(f"{what}: {where} has no attribute '{attr}'")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{what} is a {type(fn).__name__}, not a function")
    return fn


class FileFunction:
    """A function of a .py file imported by its path, called as the function is (its signature is the function's).

    It pickles as the file's path and the function's name, and unpickling imports the file: a process it is sent
    to (a reward process) could not import the function by reference, since no module on any path holds it."""

    def __init__(self, path: str, attr: str, kind: str = "plugin"):
        self.path, self.attr, self.kind = str(Path(path).resolve()), attr, kind
        self.fn = _attribute(_file_module(self.path, kind), attr, f"{kind} '{path}:{attr}'", self.path)
        functools.update_wrapper(self, self.fn, updated=())  # its name and signature; not its attributes

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return FileFunction, (self.path, self.attr, self.kind)


_FILE_MODULES: dict[str, ModuleType] = {}  # by absolute path: a file's functions share one import of it


def _file_module(path: str, kind: str) -> ModuleType:
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    if not Path(path).is_file():
        raise ImportError(f"{kind} file not found: {path}")
    # in sys.modules while it runs and after, as an import would be: dataclasses and pickle look classes up there
    name = f"megarl_file_{Path(path).stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit
            raise
        raise ImportError(f"{kind} file {path} does not import: {_failure(e, path)}") from e
    _FILE_MODULES[path] = module
    return module


def _failure(error: Exception, path: str) -> str:
    """The error and the line of `path` it was raised at (a syntax error's own line)."""
    if isinstance(error, SyntaxError) and error.filename == path:
        return f"{type(error).__name__}: {error.msg} (line {error.lineno})"
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == path]
    return f"{type(error).__name__}: {error}" + (f" (line {lines[-1]})" if lines else "")


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
