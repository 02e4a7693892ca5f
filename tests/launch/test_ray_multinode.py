"""Two Ray nodes on one machine, started by scripts/ray_cluster.sh as separate `ray start --block`
processes with their own temp dirs; the CPU recipe goes in through `ray job submit` and
scripts/ray_job.sh, and its two training ranks must run on different nodes.

Also checked on the way: the dashboard and job server listen on loopback only, they refuse a request
without the token, and SIGTERM to the two `ray start` processes leaves nothing behind.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter

import psutil

from tests.dist_utils import free_port

from tests.launch.launch_utils import (NODE_CPUS, ROOT, SPREAD_RUN, TINY_RUN, processes_with, script_env,
                                      stop_process_group, wait_until_gone)


def node_ip() -> str:
    return subprocess.run(["bash", "-c", "source scripts/env.sh && megarl_node_ip"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def start_node(role_args: list[str], temp_dir, log, env) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "scripts/ray_cluster.sh", *role_args, "--num-cpus", str(NODE_CPUS), "--temp-dir", str(temp_dir),
         "--block"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def ray_cli(args: list[str], env, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def wait_for_job_server(dashboard: str, token: str, timeout: float = 90) -> None:
    """The dashboard starts a little after `ray_cluster.sh wait` sees the nodes."""
    request = urllib.request.Request(f"{dashboard}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(request, timeout=10)
            return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_recipe_spans_two_ray_nodes(short_tmp):
    gcs_port, dash_port = free_port(), free_port()
    head_address = f"{node_ip()}:{gcs_port}"
    token_file = short_tmp / "auth_token"
    # what `source scripts/env.sh && megarl_ray_auth` sets for a client (ray job submit, ray list)
    env = script_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file),
                     MEGARL_DASHBOARD_PORT=str(dash_port))
    env.pop("RAY_AUTH_TOKEN", None)
    # made once, before the nodes start: two nodes making it at the same time could disagree
    subprocess.run(["bash", "-c", "source scripts/env.sh && megarl_ray_auth"], cwd=ROOT, env=env, check=True)
    dashboard = f"http://127.0.0.1:{dash_port}"
    with open(short_tmp / "nodes.log", "w") as log:
        head = start_node(["head", "--ip", "auto", "--port", str(gcs_port)], short_tmp / "h", log, env)
        worker = None
        try:
            worker = start_node(["worker", "--address", head_address], short_tmp / "w", log, env)
            wait = subprocess.run(["bash", "scripts/ray_cluster.sh", "wait", "--address", head_address,
                                   "--nodes", "2", "--timeout", "60"], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert wait.returncode == 0, wait.stderr[-3000:]
            assert "2 nodes" in wait.stdout

            # the token made for this cluster is readable by its owner only
            assert token_file.stat().st_mode & 0o777 == 0o600
            token = token_file.read_text()
            wait_for_job_server(dashboard, token)
            request = urllib.request.Request(f"{dashboard}/api/jobs/")
            try:
                urllib.request.urlopen(request, timeout=10)
                raise AssertionError("the job server answered a request without the token")
            except urllib.error.HTTPError as e:
                assert e.code in (401, 403), e.code
            request.add_header("Authorization", f"Bearer {token}")
            assert urllib.request.urlopen(request, timeout=10).status == 200

            submit = ["job", "submit", "--address", dashboard, "--", "bash", str(ROOT / "scripts" / "ray_job.sh"),
                      *TINY_RUN, *SPREAD_RUN, f"trainer.output_dir={short_tmp / 'run'}"]
            for _ in range(12):  # the head's job agent registers a little after the HTTP server answers
                job = ray_cli(submit, env, timeout=300)
                if "No available agent" not in job.stderr:
                    break
                time.sleep(5)
            assert job.returncode == 0 and "succeeded" in job.stdout, (job.stdout[-4000:], job.stderr[-2000:])
            assert "held-out reward" in job.stdout

            assert listening_ips(dash_port) == {"127.0.0.1"}

            # both nodes did work: one training rank on each ran its train steps, from the state API
            tasks = ray_cli(["list", "tasks", "--address", dashboard, "--filter", "name=TrainWorker.train",
                             "--filter", "state=FINISHED", "--detail", "--format", "json", "--limit", "1000"],
                            env, timeout=60)
            assert tasks.returncode == 0, tasks.stderr[-2000:]
            nodes = json.loads(ray_cli(["list", "nodes", "--address", dashboard, "--format", "json"], env,
                                       timeout=60).stdout)
            assert len(nodes) == 2
            train_calls = Counter(t["node_id"] for t in json.loads(tasks.stdout))
            # two SFT steps and one RL step on each rank
            assert train_calls == {n["node_id"]: 3 for n in nodes}, train_calls
        finally:
            for node in (worker, head):
                if node is not None:
                    stop_process_group(node)
    left = wait_until_gone(lambda: processes_with(str(short_tmp)), timeout=30)
    assert left == [], [" ".join(p.cmdline())[:200] for p in left]
