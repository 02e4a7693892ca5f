"""A Ray node lost with a training rank (megarl/recovery.py, megarl/workers/placement.py): two `ray start` nodes on one
machine (scripts/ray_cluster.sh), the CPU recipe's two training ranks one on each; the worker node's processes are
SIGKILLed after the run's first checkpoint. The node left cannot hold two ranks, so the run stops, within a bounded
time and with a non-zero exit, naming the lost node (its IP and node id) and the resources missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.dist_utils import free_port
from tests.launch.launch_utils import (NODE_CPUS, ROOT, SPREAD_RUN, TINY_RUN, processes_with, script_env,
                                      stop_process_group, wait_until_gone)
from tests.launch.test_ray_multinode import node_ip, start_node

# Ray marks a node dead after its health checks fail (about 15 s); the rest is the run noticing and shutting down
STOP_WITHIN_S = 180


def ray_nodes(address: str, env) -> list[dict]:
    """The cluster's live nodes, as a client sees them (a driver of its own, here a subprocess)."""
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps([{k: n[k] for k in ('NodeID', 'NodeManagerAddress', 'Resources')} "
            "for n in ray.nodes() if n['Alive']]))" % address)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_lost_node_that_leaves_no_room_stops_the_run_naming_it(short_tmp):
    head_address = f"{node_ip()}:{free_port()}"
    env = script_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(short_tmp / "auth_token"),
                     MEGARL_DASHBOARD_PORT=str(free_port()))
    env.pop("RAY_AUTH_TOKEN", None)
    subprocess.run(["bash", "-c", "source scripts/env.sh && megarl_ray_auth"], cwd=ROOT, env=env, check=True)
    out = short_tmp / "run"
    with open(short_tmp / "nodes.log", "w") as nodes_log, open(short_tmp / "run.log", "w") as run_log:
        head = start_node(["head", "--ip", "auto", "--port", head_address.rpartition(":")[2]], short_tmp / "h",
                          nodes_log, env)
        worker = run = None
        try:
            worker = start_node(["worker", "--address", head_address], short_tmp / "w", nodes_log, env)
            wait = subprocess.run(["bash", "scripts/ray_cluster.sh", "wait", "--address", head_address, "--nodes",
                                   "2", "--timeout", "60"], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert wait.returncode == 0, wait.stderr[-3000:]
            nodes = ray_nodes(head_address, env)
            head_id = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
            worker_id = next(n["NodeID"] for n in nodes if n["NodeID"] != head_id)
            worker_ip = next(n["NodeManagerAddress"] for n in nodes if n["NodeID"] == worker_id)

            # each 2-CPU rank needs a node of its own (NODE_CPUS=3); a checkpoint every step
            run = subprocess.Popen(
                [sys.executable, "-m", "megarl.train", *TINY_RUN, *SPREAD_RUN, "trainer.steps=200",
                 "trainer.eval_every=0", "trainer.save_every=1", f"trainer.ray_address={head_address}",
                 f"trainer.output_dir={out}"], cwd=ROOT, env=env, stdout=run_log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 600
            while not list((out / "checkpoints").glob("step_*/checkpoint.json")):
                assert run.poll() is None, (short_tmp / "run.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no checkpoint within 600 s"
                time.sleep(0.5)
            os.killpg(worker.pid, signal.SIGKILL)  # the node's raylet and every process it started
            killed = time.monotonic()
            code = run.wait(timeout=STOP_WITHIN_S + 60)
            took = time.monotonic() - killed
            log = (short_tmp / "run.log").read_text()
        finally:
            if run is not None and run.poll() is None:
                run.kill()
            for node in (worker, head):
                if node is not None:
                    stop_process_group(node)
    assert code != 0, log[-4000:]
    assert took < STOP_WITHIN_S, took
    stop = next((line for line in log.splitlines() if "RestartLimit: " in line), None)
    assert stop is not None, log[-4000:]
    assert f"with the lost Ray node(s) {worker_ip} (node {worker_id})" in stop, stop
    assert ("cannot replace them: the actor ranks need 2 bundle(s) of CPU 2 (trainer.placement=pack), and Ray's live "
            "nodes hold 1: 1 bundle(s) missing, CPU 2. Live nodes: ") in stop, stop
    assert f"(node {head_id}): CPU {NODE_CPUS}" in stop and worker_id not in stop.split("Live nodes: ")[1], stop
    left = wait_until_gone(lambda: processes_with(str(short_tmp)), timeout=30)
    assert left == [], [" ".join(p.cmdline())[:200] for p in left]
