"""SGLang servers do not outlive what started them: the trainer's shutdown path (stop_rollout: the rollout
actor's RolloutWorker.shutdown, then ray.kill), a ray.kill alone, and a SIGKILLed owner process (the server
guard). The servers are fake_sglang.py processes launched by the real code path: RolloutWorker builds
SGLangRolloutEngine, which runs `python -m sglang.launch_server ...`, here a stand-in package that starts
fake_sglang.py on the given port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megarl.config.tiny import tiny_config

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_sglang.py")


def process_alive(pid: int) -> bool:
    """Running (a zombie is dead: it holds no memory, only waits to be reaped by a parent that may never do it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def servers_of(marker: str) -> list[tuple[int, int]]:
    """(guard pid, server pid) of the guarded servers whose command line contains `marker`."""
    guards, parents = [], {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if marker in cmdline:
            (guards if "server_guard.py" in cmdline else parents.setdefault(ppid, [])).append(int(proc.name))
    return [(guard, server) for guard in guards for server in parents.get(guard, [])]


def wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(map(process_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if process_alive(pid)]


@pytest.fixture(scope="module")
def ray_with_fake_sglang(tmp_path_factory):
    """Local Ray whose workers find `sglang.launch_server` = fake_sglang.py."""
    import ray

    shim = tmp_path_factory.mktemp("shim")
    (shim / "sglang").mkdir()
    (shim / "sglang" / "__init__.py").write_text("")
    (shim / "sglang" / "launch_server.py").write_text(textwrap.dedent(f"""
        import runpy, sys
        port = sys.argv[sys.argv.index("--port") + 1]
        sys.argv = [{str(FAKE)!r}, "--port", port]
        runpy.run_path({str(FAKE)!r}, run_name="__main__")
        """))
    path = os.pathsep.join([str(shim), str(REPO), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    yield
    ray.shutdown()


def rollout_actor(tmp_path, name: str, overrides: tuple = ()):
    import ray

    from megarl.workers.group import start_rollout

    model = tmp_path / name  # unique: marks this actor's server in /proc
    model.mkdir()
    (tmp_path / "out").mkdir(exist_ok=True)  # the trainer makes it before the actors start
    cfg = tiny_config(["rollout.engine=sglang", f"trainer.output_dir={tmp_path / 'out'}",
                             "trainer.verify_weight_sync_every=0", *overrides])
    actor = start_rollout(cfg, str(model), "cpu")
    ray.get(actor.resident_bytes.remote(), timeout=120)  # constructed: the server is up
    (pair,) = servers_of(str(model))
    return actor, pair


def test_stop_rollout_shuts_the_engine_servers_down(ray_with_fake_sglang, tmp_path):
    from megarl.workers.group import stop_rollout

    actor, (guard, server) = rollout_actor(tmp_path, "model-stop", ("rollout.sglang_env={MEGARL_ENV_PROBE: 7}",))
    assert process_alive(guard) and process_alive(server)
    assert b"\0MEGARL_ENV_PROBE=7\0" in Path(f"/proc/{server}/environ").read_bytes()  # the config's env reached it
    stop_rollout(actor)  # what RLTrainer.shutdown does
    # gone when it returns: the engine shut them down (the guards would take a second or more after ray.kill)
    assert [pid for pid in (guard, server) if process_alive(pid)] == []


def test_killed_rollout_actor_takes_its_servers_along(ray_with_fake_sglang, tmp_path):
    import ray

    actor, (guard, server) = rollout_actor(tmp_path, "model-kill")
    ray.kill(actor)  # no shutdown call: the guard notices its parent is gone
    assert wait_gone([guard, server], 15.0) == []


def test_guard_ends_the_server_of_a_sigkilled_owner(tmp_path):
    """Without Ray: an owner process starts a server and is SIGKILLed; the server is in a session of its own,
    so only the guard can end it."""
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from megarl.rollout.sglang_server import SGLangServer, free_port
        port = free_port()
        SGLangServer([sys.executable, {str(FAKE)!r}, "--port", str(port)], port,
                     log_path={str(tmp_path / 'server.log')!r}, startup_timeout=30).start()
        print("up", port, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        up, port = owner.stdout.readline().split()
        assert up == "up"
        # this owner's server alone, by its port: other modules' fake servers may run meanwhile (xdist)
        (guard, server), = servers_of(f"{FAKE} --port {port} ")
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert wait_gone([guard, server], 15.0) == []
    finally:
        owner.kill()
