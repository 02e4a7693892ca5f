"""Clusters as verl's guides make them: a plain `ray start --head`, then the CPU recipe through `ray job submit` with
megarl/runtime_env.yaml, or as a plain `python -m megarl.train` that joins the cluster (start_ray: trainer.ray_address,
RAY_ADDRESS, the cluster `ray start` recorded on this node, else a local one); a cluster too small for the run is
refused at once; scripts/ray_cluster.sh takes `ray start`'s spellings.

One head serves the module. It runs with RAY_TMPDIR in a temp dir of its own, so its record of the cluster
(ray_current_cluster) is found only by the drivers given that RAY_TMPDIR, and it is stopped by SIGTERM to its
`ray start --block`: never `ray stop`, which would stop every Ray of this user on the machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types

import pytest
import yaml

from megarl.train import cluster_to_join, rl_gpus_needed
from megarl.utils.tracking import run_dir
from tests.launch.launch_utils import ROOT, processes_with, script_env, stop_process_group, wait_until_gone
from tests.launch.test_ray_multinode import free_port, wait_for_job_server

NODE_CPUS = 4
RUN = ["--config", "configs/quickstart.yaml", "trainer.steps=2", "sft.steps=2", "data.prompts_per_step=4",
       "rollout.n_samples=4", "data.val_size=8", "trainer.loggers=jsonl"]
# the smallest run that joins and finishes: one training rank of one layer
ONE_RANK = [*RUN, "actor.parallel.world_size=1", "actor.parallel.tp=1", "model.tiny_num_layers=1", "trainer.steps=1",
            "sft.steps=0"]


@pytest.fixture(scope="module")
def cluster():
    """A one-node cluster of NODE_CPUS CPUs from a plain `ray start --head`, with a token of its own; yields
    (temp dir, GCS port, dashboard URL, env for clients holding the token, the head's process)."""
    tmp = tempfile.mkdtemp(prefix="mrj", dir="/tmp")  # short: Ray's Unix socket paths are limited to 107 bytes
    token = os.path.join(tmp, "auth_token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    env = script_env(RAY_AUTH_TOKEN_PATH=token, RAY_TMPDIR=tmp)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(key, None)
    gcs, dash = free_port(), free_port()
    log = open(os.path.join(tmp, "head.log"), "w")
    # RAY_AUTH_MODE unset, as on a user's machine: `ray start` turns token authentication on where a token exists
    head = subprocess.Popen(
        ["ray", "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}", f"--num-cpus={NODE_CPUS}",
         f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats", "--block"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        record = os.path.join(tmp, "ray", "ray_current_cluster")
        deadline = time.monotonic() + 120
        while not os.path.exists(record):
            assert head.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.5)
        client = env | {"RAY_AUTH_MODE": "token"}  # what megarl_ray_auth sets for `ray job` commands
        wait_for_job_server(f"http://127.0.0.1:{dash}", open(token).read())
        yield tmp, gcs, f"http://127.0.0.1:{dash}", client, head
    finally:
        stop_process_group(head)
        log.close()
        left = wait_until_gone(lambda: processes_with(tmp), timeout=30)
        for p in left:  # what SIGTERM to the head left behind: this cluster's processes only
            p.kill()
        subprocess.run(["rm", "-rf", tmp], check=False)
        assert left == [], [" ".join(p.cmdline())[:200] for p in left]


def submit(cluster, entrypoint: list[str], timeout: float) -> subprocess.CompletedProcess:
    _, _, dashboard, env, _ = cluster
    command = ["ray", "job", "submit", "--address", dashboard, "--runtime-env", "megarl/runtime_env.yaml", "--",
               *entrypoint]
    for _ in range(12):  # the head's job agent registers a little after the HTTP server answers
        job = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if "No available agent" not in job.stderr:
            return job
        time.sleep(5)
    return job


def driver_env(cluster, **extra) -> dict[str, str]:
    """A shell's environment on the head node: the token's path, and neither RAY_AUTH_MODE nor the head's RAY_TMPDIR
    unless given."""
    env = {k: v for k, v in cluster[3].items() if k not in ("RAY_AUTH_MODE", "RAY_TMPDIR")}
    return env | extra


def test_job_submit_with_the_runtime_env_runs_the_recipe(cluster, tmp_path):
    gcs = cluster[1]
    job = submit(cluster, ["python3", "-m", "megarl.train", *RUN, f"trainer.output_dir={tmp_path}"], timeout=400)
    assert job.returncode == 0 and "succeeded" in job.stdout, (job.stdout[-4000:], job.stderr[-2000:])
    assert f":{gcs} (RAY_ADDRESS): 1 node(s), {NODE_CPUS} CPUs" in job.stdout, job.stdout[-4000:]
    assert "held-out reward" in job.stdout
    assert (run_dir(tmp_path) / "metrics.jsonl").exists()  # the absolute output path, outside the job's unpacked copy


def test_runtime_env_reaches_the_workers_and_uploads_the_checkout_without_venv_or_runs(cluster):
    probe = ("import os, ray; ray.init(); f = ray.remote(lambda: (dict(os.environ), sorted(os.listdir('.')))); "
             "env, files = ray.get(f.remote()); print('PROBE', __import__('json').dumps([env, files]))")
    job = submit(cluster, ["python3", "-c", probe], timeout=120)
    assert job.returncode == 0, (job.stdout[-3000:], job.stderr[-2000:])
    env, files = json.loads(job.stdout.split("PROBE ", 1)[1].splitlines()[0])
    wanted = yaml.safe_load((ROOT / "megarl" / "runtime_env.yaml").read_text())["env_vars"]
    assert {k: env.get(k) for k in wanted} == wanted
    assert {"megarl", "configs", "scripts"} <= set(files) and not {".venv", "runs", ".git"} & set(files), files


def test_runtime_env_agrees_with_env_sh():
    """Each variable the runtime env sets has the value scripts/env.sh exports for a shell (megarl_nccl_env's
    defaults included)."""
    wanted = yaml.safe_load((ROOT / "megarl" / "runtime_env.yaml").read_text())["env_vars"]
    shell = subprocess.run(["bash", "-c", "source scripts/env.sh && megarl_nccl_env && env -0"], cwd=ROOT,
                           env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}, capture_output=True, text=True)
    exported = dict(line.split("=", 1) for line in shell.stdout.split("\0") if "=" in line)
    assert {k: exported.get(k) for k in wanted} == wanted


def test_plain_driver_joins_ray_address_and_leaves_the_cluster_up(cluster, tmp_path):
    tmp, gcs, _, _, head = cluster
    run = subprocess.run([sys.executable, "-m", "megarl.train", *ONE_RANK, f"trainer.output_dir={tmp_path}"],
                         cwd=ROOT, env=driver_env(cluster, RAY_ADDRESS=f"127.0.0.1:{gcs}"), capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert (f"megarl: joined the Ray cluster at 127.0.0.1:{gcs} (RAY_ADDRESS): 1 node(s), {NODE_CPUS} CPUs"
            in run.stdout), run.stdout[-3000:]
    assert "held-out reward" in run.stdout
    # the driver's ray.shutdown() disconnected: the cluster's GCS and head are still there
    assert head.poll() is None
    assert any("gcs_server" in " ".join(p.cmdline()) for p in processes_with(tmp))
    socket.create_connection(("127.0.0.1", gcs), timeout=5).close()


def test_too_small_a_cluster_is_refused_at_once_naming_the_keys(cluster, tmp_path):
    tmp = cluster[0]
    # no RAY_ADDRESS: the cluster is found by its record (RAY_TMPDIR as its `ray start` had it)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "megarl.train", *RUN, f"trainer.output_dir={tmp_path}",
                          "trainer.cpus_per_rank=2", "rollout.num_cpus=1"], cwd=ROOT,
                         env=driver_env(cluster, RAY_TMPDIR=tmp), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.stdout[-2000:], run.stderr[-3000:])
    record = os.path.join(tmp, "ray", "ray_current_cluster")
    assert f"({record}): 1 node(s), {NODE_CPUS} CPUs" in run.stdout, run.stdout[-2000:]
    assert (f"needs 5 CPUs, and it has {NODE_CPUS}: trainer.cpus_per_rank=2 per training rank" in run.stderr
            and "rollout.num_cpus=1" in run.stderr), run.stderr[-2000:]
    assert time.monotonic() - start < 90  # refused before any placement group waits
    assert not (tmp_path / "logs").exists()


def config(address: str = ""):
    return types.SimpleNamespace(trainer=types.SimpleNamespace(ray_address=address))


def test_join_order(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert cluster_to_join(config()) is None  # no record: start a local one
    with pytest.raises(SystemExit) as e:
        cluster_to_join(config("auto"))  # auto never starts one
    assert e.value.code == 2 and "trainer.ray_address=auto: no Ray cluster to join" in capsys.readouterr().err

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    live = f"127.0.0.1:{listener.getsockname()[1]}"
    record = tmp_path / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    record.write_text(live + "\n")
    assert cluster_to_join(config()) == (live, str(record))
    listener.close()
    assert cluster_to_join(config()) is None  # a stale record (a node ended without `ray stop`) is passed over
    record.write_text(live)

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # the job server's URL, for `ray job` commands
    assert cluster_to_join(config()) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_to_join(config()) == ("10.0.0.1:6379", "RAY_ADDRESS")
    assert cluster_to_join(config("10.0.0.2:6379")) == ("10.0.0.2:6379", "trainer.ray_address")
    assert cluster_to_join(config("local")) is None


def test_rl_gpus_needed_counts_shared_rank_gpus_and_sglang_gpus():
    from megarl.config.tiny import tiny_config

    grpo = tiny_config(["actor.parallel.world_size=2"], path=str(ROOT / "configs" / "quickstart.yaml"))
    assert rl_gpus_needed(grpo) == pytest.approx(0.9 * 2 + 0.1)  # two ranks, and a sliver for the rollout actor
    ppo = tiny_config(["algorithm.advantage=gae", "critic.parallel.world_size=2", "rollout.engine=sglang",
                       "rollout.sglang_gpus=2"], path=str(ROOT / "configs" / "quickstart.yaml"))
    assert rl_gpus_needed(ppo) == pytest.approx(0.9 * 2 + 2)  # the critic shares the policy's GPUs


@pytest.mark.parametrize("args, expected", [
    (["--head", "--port=6379", "--dashboard-host=0.0.0.0", "--dashboard-port=8265", "--num-cpus=4", "--block"],
     ["--head", "--node-ip-address=127.0.0.1", "--port=6379", "--dashboard-host=0.0.0.0", "--dashboard-port=8265",
      "--num-cpus=4", "--block"]),
    (["--head", "--node-ip-address", "10.0.0.1", "--port", "7000", "--num-gpus", "8"],
     ["--head", "--node-ip-address=10.0.0.1", "--port=7000", "--dashboard-host=127.0.0.1", "--num-gpus=8"]),
    (["--address=192.168.1.10:6379", "--node-ip-address=192.168.1.11", "--num-gpus=8"],
     ["--address=192.168.1.10:6379", "--node-ip-address=192.168.1.11", "--num-gpus=8"]),
    (["--address", "192.168.1.10:6379", "--node-ip-address", "192.168.1.12", "--block"],
     ["--address=192.168.1.10:6379", "--node-ip-address=192.168.1.12", "--block"]),
    (["head", "--ip", "10.0.0.1", "--dashboard-port", "9000"],
     ["--head", "--node-ip-address=10.0.0.1", "--port=6379", "--dashboard-port=9000"]),
])
def test_ray_cluster_takes_rays_spellings(args, expected, tmp_path):
    env = script_env(HOME=str(tmp_path))
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "MEGARL_DASHBOARD_HOST", "MEGARL_DASHBOARD_PORT",
                "MEGARL_RAY_PORT"):
        env.pop(key, None)
    result = subprocess.run(["bash", "scripts/ray_cluster.sh", *args, "--dry-run"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    assert command[:2] == ["ray", "start"] and set(expected) <= set(command), command
    assert not (tmp_path / ".ray").exists()  # a dry run makes no token


@pytest.mark.parametrize("args, message", [
    (["--head", "--address=10.0.0.1:6379"], "head takes no --address"),
    (["worker", "--head"], "--head with role 'worker'"),
    (["--address=10.0.0.1:6379", "--dashboard-host=0.0.0.0"], "are the head's"),
    (["--num-gpus=8"], "usage"), (["--head", "--port"], "--port needs a value")])
def test_ray_cluster_rejects_mixed_spellings(args, message):
    result = subprocess.run(["bash", "scripts/ray_cluster.sh", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr
