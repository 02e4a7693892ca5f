"""Fixtures for the launch tests (helpers live in launch_utils.py)."""

import pathlib
import subprocess
import tempfile

import pytest


@pytest.fixture
def short_tmp():
    """A short directory: Ray puts Unix sockets under its temp dir, and their paths are limited to 107 bytes."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="mrl", dir="/tmp"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)
