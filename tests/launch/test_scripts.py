"""The launch scripts' environment handling (scripts/env.sh), argument checks, and shellcheck."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.launch.launch_utils import ROOT

SCRIPTS = ["scripts/env.sh", "scripts/launch.sh", "scripts/ray_cluster.sh", "scripts/ray_job.sh",
           "scripts/slurm/megarl.sbatch", "docker/build.sh"]


def env_sh(code: str, **env) -> subprocess.CompletedProcess:
    """Run `code` in bash after sourcing scripts/env.sh, with only `env` (and PATH, HOME) set."""
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": env.pop("HOME", "/nonexistent")}
    return subprocess.run(["bash", "-c", f"source scripts/env.sh && {code}"], cwd=ROOT, env=base | env,
                          capture_output=True, text=True)


def test_ray_auth_creates_a_private_token_once(tmp_path):
    token = tmp_path / "ray" / "token"
    first = env_sh('megarl_ray_auth && echo "$RAY_AUTH_MODE $RAY_AUTH_TOKEN_PATH"', RAY_AUTH_TOKEN_PATH=str(token))
    assert first.stdout.split() == ["token", str(token)], first.stderr
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    before = token.read_text()
    env_sh("megarl_ray_auth", RAY_AUTH_TOKEN_PATH=str(token))
    assert token.read_text() == before  # an existing token is kept: every node must share it
    # a token in the environment wins; no file is made
    given = env_sh('megarl_ray_auth && echo "$RAY_AUTH_TOKEN_PATH|$RAY_AUTH_TOKEN"', RAY_AUTH_TOKEN="abc",
                   HOME=str(tmp_path))
    assert given.stdout.strip() == "|abc" and not (tmp_path / ".ray").exists()


def test_nccl_env_keeps_what_the_user_set():
    out = env_sh('megarl_nccl_env && echo "$NCCL_DEBUG $NCCL_NVLS_ENABLE $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"',
                 NCCL_DEBUG="INFO", MEGARL_IFNAME="ib0").stdout.split()
    assert out == ["INFO", "0", "ib0", "ib0"]
    unset = env_sh('megarl_nccl_env && echo "${NCCL_SOCKET_IFNAME-unset}"').stdout.strip()
    assert unset == "unset"


def test_node_ip_and_dirs(tmp_path):
    assert env_sh("megarl_node_ip", MEGARL_IFNAME="lo").stdout.strip() == "127.0.0.1"
    missing = env_sh("megarl_node_ip", MEGARL_IFNAME="no-such-if0")
    assert missing.returncode != 0 and "no-such-if0" in missing.stderr
    out = env_sh('megarl_dirs && echo "$MEGARL_LOG_DIR $MEGARL_CKPT_DIR"', MEGARL_LOG_DIR=str(tmp_path / "l"),
                 MEGARL_CKPT_DIR=str(tmp_path / "c"))
    assert out.stdout.split() == [str(tmp_path / "l"), str(tmp_path / "c")]
    assert (tmp_path / "l").is_dir() and (tmp_path / "c").is_dir()


@pytest.mark.parametrize("args, message", [
    ([], "usage"), (["worker"], "worker needs --address"), (["wait", "--nodes", "2"], "wait needs --address"),
    (["head", "--bogus", "1"], "unknown option --bogus"), (["boss"], "unknown role 'boss'")])
def test_ray_cluster_rejects_bad_arguments(args, message):
    result = subprocess.run(["bash", "scripts/ray_cluster.sh", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr


def test_shellcheck_passes():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck; docs/launching.md)")
    result = subprocess.run(["shellcheck", "-x", "-s", "bash", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
