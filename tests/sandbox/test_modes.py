"""What each sandbox mode keeps private; that a mode which cannot keep a program to its own files runs only under
its unsafe- name; that auto means bubblewrap or a named error; that the private /tmp holds no more than its size."""

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

import megarl
from megarl.config import Config, ConfigError, RewardConfig
from megarl.config.tiny import tiny_config
from megarl.rewards import build_reward
from megarl.rewards.loading import check_reward
from megarl.sandbox import runner
from megarl.sandbox.runner import Sandbox, SandboxLimits

AS_ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(wall_s=10.0, memory_mb=256, max_processes=8)
CHECKOUT = Path(megarl.__file__).resolve().parents[1]
NAMESPACED = [pytest.param(mode, marks=pytest.mark.skipif(not shutil.which(tool), reason=f"'{tool}' is not installed"))
              for mode, tool in (("bwrap", "bwrap"), ("unsafe-namespaces", "unshare"))]


def run_once(mode: str, code: str):
    box = Sandbox(LIMITS, mode=mode)
    try:
        return box, box.run(code)
    finally:
        box.close()


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
    _, result = run_once(mode, code)
    assert result.ok, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("wrote")] == \
        ["wrote /tmp", "wrote /dev/shm", "wrote /var/tmp"]  # the writes worked, somewhere private
    assert "read" not in result.stdout and "listed ['" not in result.stdout  # megarl's source is out of sight
    for directory in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not os.path.exists(os.path.join(directory, marker))  # and nothing was left on the host


@pytest.mark.parametrize("mode", ["rlimits", "namespaces"])
def test_a_mode_that_leaves_the_host_open_is_refused_by_its_short_name(mode):
    with pytest.raises(ValueError, match=rf"sandbox mode '{mode}' does not keep a program to its own files: .*"
                                         rf"bubblewrap.*reward\.code_sandbox=unsafe-{mode}"):
        Sandbox(LIMITS, mode=mode)
    with pytest.raises(ConfigError, match=rf"reward\.code_sandbox='{mode}': must be one of auto, bwrap, "
                                          r"unsafe-namespaces, unsafe-rlimits"):
        Config(reward=RewardConfig(name="code", code_sandbox=mode)).validate()


def test_auto_without_bubblewrap_is_an_error_that_says_how_to_install_it_or_opt_in(monkeypatch):
    monkeypatch.setattr(runner.shutil, "which", lambda name: None)  # neither bwrap nor unshare
    with pytest.raises(RuntimeError, match=r"sandbox mode 'auto' does not work on this host \('bwrap' is not installed\)"
                                           r": install bubblewrap \(apt-get install -y bubblewrap.*"
                                           r"reward\.code_sandbox=unsafe-namespaces or unsafe-rlimits"):
        Sandbox(LIMITS, mode="auto")
    # and before anything starts: check_reward runs at --check-config, --dry-run and a run's start
    for key in ("reward.name=code", "reward.name=data_source"):  # the second: a row of data_source apps
        cfg = tiny_config([key, "reward.code_sandbox=auto"])
        row = {"prompt": "p", "answer": json.dumps({"asserts": ["assert f() == 1"]}), "data_source": "apps"}
        with pytest.raises(ConfigError, match=r"reward\.code_sandbox=auto: the code reward's sandbox cannot run here "
                                              r"\('bwrap' is not installed\): install bubblewrap"):
            check_reward(cfg, row)


def test_auto_where_bubblewrap_cannot_run_is_an_error_too(monkeypatch):
    # installed but failing, as where unprivileged user namespaces are off: never a fall back to a weaker mode
    which = shutil.which
    monkeypatch.setattr(runner.shutil, "which", lambda name: "/bin/false" if name == "bwrap" else which(name))
    with pytest.raises(RuntimeError, match=r"sandbox mode 'auto' does not work on this host \(bwrap: exit 1\): "
                                           r"install bubblewrap"):
        Sandbox(LIMITS, mode="auto")


def test_unsafe_rlimits_keeps_its_files_in_a_private_directory_it_removes():
    marker = f"/tmp/megarl-left-{uuid.uuid4().hex}"
    code = f"""
import os, tempfile
open("in-cwd", "w").write("x")
named = tempfile.NamedTemporaryFile(delete=False)
os.makedirs(os.path.join(tempfile.gettempdir(), "a-dir"))
open({marker!r}, "w").write("x")  # a path outside its directory: only root's uid per run finds it again
print(os.getcwd(), os.environ["HOME"], named.name)
"""
    box, result = run_once("unsafe-rlimits", code)
    assert result.ok, result.stderr
    cwd, home, temporary = result.stdout.split()
    assert cwd == home and temporary.startswith(cwd + "/") and Path(cwd).parent == box.root
    assert not os.path.exists(cwd) and not box.root.exists()  # the run's directory, then the sandbox's, removed
    if AS_ROOT:
        assert not os.path.exists(marker)
    else:
        os.unlink(marker)  # the documented gap: the caller's own uid, nothing to tell the run's files by


@pytest.mark.parametrize("cgroup", [True, False], ids=["memory cgroup", "no memory cgroup"])
@pytest.mark.parametrize("mode", NAMESPACED)
def test_the_private_tmp_holds_no_more_than_its_size(mode, cgroup, monkeypatch):
    if not cgroup:  # the case that leaked: nothing but the tmpfs size bounds what the files hold
        monkeypatch.setattr(runner.MemoryCgroups, "find", classmethod(lambda cls: (None, "not delegated here")))
    marker = f"megarl-fill-{uuid.uuid4().hex}"
    code = f"""
import os, resource
for directory in ("/tmp", "/var/tmp", "/dev/shm", "/dev"):
    written = 0
    try:
        for part in range(1000):  # files of 1 MiB: the file size limit is not what stops it
            with open(os.path.join(directory, f"{marker}-{{part}}"), "wb") as f:
                f.write(b"x" * (1 << 20))
            written += 1
    except OSError as e:
        print(directory, written, e.errno)
    for part in range(written):  # room again for the next directory (/var/tmp shares /tmp's)
        os.unlink(os.path.join(directory, f"{marker}-{{part}}"))
print("address space", resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)
"""
    box, result = run_once(mode, code)
    assert result.ok, result.stderr
    tmp_mb = LIMITS.tmp_mb
    lines = result.stdout.splitlines()
    for line, directory in zip(lines, ("/tmp", "/var/tmp", "/dev/shm")):
        name, written, errno = line.split()
        assert name == directory and tmp_mb - 1 <= int(written) <= tmp_mb and int(errno) == 28  # ENOSPC at the size
    assert lines[3].startswith("/dev 0 ")  # /dev itself takes no file
    assert lines[4] == f"address space {LIMITS.memory_mb - (0 if cgroup else 2 * tmp_mb)}"  # files + processes fit
    assert not [name for name in os.listdir("/tmp") + os.listdir("/dev/shm") if name.startswith(marker)]


def test_the_code_reward_takes_its_sandbox_mode_from_the_config():
    reward = build_reward(RewardConfig(name="code", code_sandbox="unsafe-rlimits", code_timeout_s=5.0,
                                       code_memory_mb=256))
    try:
        assert reward.sandbox.mode == "unsafe-rlimits"
        assert reward("def add(a, b):\n    return a + b\n", json.dumps({"asserts": ["assert add(2, 2) == 4"]}), {}) == 1.0
    finally:
        reward.close()
    with pytest.raises(ConfigError, match="reward.code_sandbox='chroot'"):
        Config(reward=RewardConfig(name="code", code_sandbox="chroot")).validate()
