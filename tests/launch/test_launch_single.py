"""scripts/launch.sh on one machine: the CPU recipe runs, its log file is written, and no process of the
run (driver, Ray's servers, rollout actor) listens on anything but loopback. The training ranks'
torch.distributed rendezvous still does (an expected failure until megarl/parallel binds it)."""

from __future__ import annotations

import subprocess
import time

import psutil

from tests.launch.launch_utils import ROOT, TINY_RUN, non_loopback_listeners, script_env, tree_pids


def test_launch_runs_the_recipe_on_loopback_only(tmp_path):
    env = script_env(MEGARL_LOG_DIR=str(tmp_path / "logs"), RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    proc = subprocess.Popen(["bash", "scripts/launch.sh", *TINY_RUN, f"trainer.output_dir={tmp_path / 'run'}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    root, exposed, seen = psutil.Process(proc.pid), set(), 0
    # sample the run's listening sockets until it ends
    while proc.poll() is None:
        pids = tree_pids(root)
        seen = max(seen, len(pids))
        exposed.update(non_loopback_listeners(pids))
        time.sleep(0.5)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-5000:]
    assert "held-out reward" in out
    assert seen > 5  # the sampling saw Ray's processes, not just the shell
    logs = list((tmp_path / "logs").glob("megarl-*.log"))
    assert len(logs) == 1 and "held-out reward" in logs[0].read_text()
    # Ray's servers, the driver, the rollout actor and the training ranks' rendezvous: loopback only
    assert exposed == set()
