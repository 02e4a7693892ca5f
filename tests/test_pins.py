"""The pins file is the one source of versions: setup.py and the installed environment agree with it."""

import ast
import importlib.metadata as md
import pathlib
import re

import torch

from megarl.pins import load_pins

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_setup_reads_versions_from_pins():
    text = (ROOT / "setup.py").read_text()
    assert "pins.toml" in text
    # no version number is written into setup.py itself
    assert not re.search(r"==\s*\d", text)


def test_installed_versions_match_pins():
    pins = load_pins()
    # the test extras include the trackers; scripts/test.sh installs [test-no-deps] beside them
    for name, version in (pins["common"] | pins["trackers"] | pins["test-no-deps"]).items():
        assert md.version(name.split("[")[0]) == version, name
    expected_torch = pins["gpu" if torch.cuda.is_available() else "cpu"]["torch"]
    assert torch.__version__.split("+")[0] == expected_torch


def test_version_is_exposed():
    import megarl
    tree = ast.parse((ROOT / "megarl" / "__init__.py").read_text())
    assert any(isinstance(n, ast.Assign) and n.targets[0].id == "__version__" for n in tree.body)
    assert re.fullmatch(r"\d+\.\d+\.\d+", megarl.__version__)
