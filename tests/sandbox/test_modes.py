"""What the modes without bubblewrap keep private, and that the weakest one is used only by name."""

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

import megarl
from megarl.config import ConfigError, RewardConfig
from megarl.rewards import build_reward
from megarl.sandbox import runner
from megarl.sandbox.runner import Sandbox, SandboxLimits

LIMITS = SandboxLimits(wall_s=10.0, memory_mb=256, max_processes=8)
CHECKOUT = Path(megarl.__file__).resolve().parents[1]
NAMESPACED = [pytest.param(mode, marks=pytest.mark.skipif(not shutil.which(tool), reason=f"'{tool}' is not installed"))
              for mode, tool in (("bwrap", "bwrap"), ("namespaces", "unshare"))]


@pytest.mark.parametrize("mode", NAMESPACED)
def test_temporary_files_and_the_checkout_stay_private(mode):
    marker = f"megarl-leak-{uuid.uuid4().hex}"
    source = Path(runner.__file__).resolve()
    code = f"""
import os
for directory in ("/tmp", "/dev/shm", "/var/tmp"):
    with open(os.path.join(directory, {marker!r}), "w") as f:
        f.write("x" * 4096)
    print("wrote", directory)
for path in ({str(source)!r}, {str(CHECKOUT / "README.md")!r}):
    try:
        print("read", len(open(path).read()))
    except OSError as e:
        print("denied", e.errno)
try:
    print("listed", os.listdir({str(CHECKOUT)!r}))
except OSError as e:
    print("denied", e.errno)
"""
    box = Sandbox(LIMITS, mode=mode)
    try:
        result = box.run(code)
    finally:
        box.close()
    assert result.ok, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("wrote")] == \
        ["wrote /tmp", "wrote /dev/shm", "wrote /var/tmp"]  # the writes worked, somewhere private
    assert "read" not in result.stdout and "listed ['" not in result.stdout  # megarl's source is out of sight
    for directory in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not os.path.exists(os.path.join(directory, marker))  # and nothing was left on the host


def test_auto_never_falls_back_to_rlimits(monkeypatch):
    monkeypatch.setattr(runner.shutil, "which", lambda name: None)  # neither bwrap nor unshare
    with pytest.raises(RuntimeError, match=r"mode='rlimits'.*reward.code_sandbox=rlimits.*bubblewrap"):
        Sandbox(LIMITS, mode="auto")


def test_rlimits_by_name_runs_with_a_private_tmpdir():
    box = Sandbox(LIMITS, mode="rlimits")
    try:
        result = box.run("import tempfile\nf = tempfile.NamedTemporaryFile(delete=False)\nprint(f.name)\n")
    finally:
        box.close()
    assert result.ok, result.stderr
    path = result.stdout.strip()
    assert path.startswith(str(box.root)) and not os.path.exists(path)  # inside the run's directory, removed


def test_the_code_reward_takes_its_sandbox_mode_from_the_config():
    reward = build_reward(RewardConfig(name="code", code_sandbox="rlimits", code_timeout_s=5.0, code_memory_mb=256))
    try:
        assert reward.sandbox.mode == "rlimits"
        assert reward("def add(a, b):\n    return a + b\n", json.dumps({"asserts": ["assert add(2, 2) == 4"]}), {}) == 1.0
    finally:
        reward.close()
    with pytest.raises(ConfigError, match="reward.code_sandbox='chroot'"):
        from megarl.config import Config
        Config(reward=RewardConfig(name="code", code_sandbox="chroot")).validate()
