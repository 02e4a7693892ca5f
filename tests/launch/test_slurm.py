"""scripts/slurm/megarl.sbatch against a real Slurm: two nodes, each in its own network namespace
(tests/launch/slurm_cluster.py), container mode `none`. One job runs the CPU recipe to the end with a
training rank on each node; another is cancelled once its Ray cluster is up and must leave no process.

Skipped without root or Debian's slurm-wlm and munge (docs/launching.md says how CI installs them).
"""

from __future__ import annotations

import glob
import shutil
import time

import pytest

from tests.launch.launch_utils import (NODE_CPUS, ROOT, SPREAD_RUN, TINY_RUN, processes_of_slurm_job, script_env,
                                      wait_until_gone)
from tests.launch.slurm_cluster import LocalSlurm, missing_requirements

pytestmark = pytest.mark.skipif(bool(missing_requirements()),
                                reason=f"needs a local Slurm: missing {', '.join(missing_requirements())}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=NODE_CPUS).start()
    yield cluster
    cluster.stop()
    for job in cluster.jobs:  # each node's Ray temp dir (sbatch leaves them for the logs)
        for job_dir in glob.glob(f"/tmp/ray_{job}_*"):
            shutil.rmtree(job_dir, ignore_errors=True)


def submit(slurm: LocalSlurm, out_dir, overrides: list[str]) -> str:
    # eth0 is each namespace's link to the others; gloo cannot find it from the node's name (not in DNS)
    # the cluster wait is a bound: a worker node joins Ray in seconds, in over a minute on 2 oversubscribed cores
    env = script_env(MEGARL_CONTAINER="none", MEGARL_CPUS_PER_NODE=str(NODE_CPUS), MEGARL_IFNAME="eth0",
                     MEGARL_WAIT_TIMEOUT="240", MEGARL_LOG_DIR=str(out_dir / "logs"),
                     MEGARL_CKPT_DIR=str(out_dir / "ckpt"))
    return slurm.sbatch([f"--output={out_dir}/job-%j.out", "scripts/slurm/megarl.sbatch", *TINY_RUN, *SPREAD_RUN,
                         f"trainer.output_dir={out_dir / 'run'}", *overrides], env=env, cwd=ROOT)


def actor_logs(job_id: str, node: str, actor: str) -> list[str]:
    """Ray's per-worker logs on `node` that belong to an actor of class `actor`."""
    logs = glob.glob(f"/tmp/ray_{job_id}_{node}/session_latest/logs/worker-*.out")
    return [f for f in logs if f":actor_name:{actor}" in open(f).read()]


def test_job_runs_the_recipe_across_both_nodes(slurm, tmp_path):
    job = submit(slurm, tmp_path, [])
    # two Ray nodes, a trainer on each, the recipe: ~145 s at a load of 30 on 2 cores; a bound, not a wait
    state = slurm.wait_job(job, timeout=480)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", out[-6000:]
    assert f"ray cluster at {slurm.ips['n1']}:6379: 2 nodes" in out
    assert "held-out reward" in out
    # one training rank per node (each node keeps its own Ray logs, under its own temp dir)
    assert [len(actor_logs(job, n, "TrainWorker")) for n in slurm.nodes] == [1, 1]
    assert wait_until_gone(lambda: processes_of_slurm_job(job), timeout=30) == []


def test_cancelled_job_leaves_no_process(slurm, tmp_path):
    job = submit(slurm, tmp_path, ["trainer.steps=1000"])
    out_file = tmp_path / f"job-{job}.out"
    deadline = time.monotonic() + 180
    # cancel once the driver has joined the two-node cluster and started the training ranks
    while not (out_file.exists() and "megarl: world_size=2" in out_file.read_text()):
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), out_file.read_text()[-4000:]
        assert time.monotonic() < deadline, "the job did not start training in 180 s"
        time.sleep(0.5)
    assert len(processes_of_slurm_job(job)) > 5  # the Ray processes of both nodes and the driver
    slurm.scancel(job)
    assert slurm.wait_job(job, timeout=60) == "CANCELLED"
    left = wait_until_gone(lambda: processes_of_slurm_job(job), timeout=30)
    assert left == [], [" ".join(p.cmdline())[:200] for p in left]
