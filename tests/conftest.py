"""Fixtures shared by the tests that run the whole system through Ray."""

import os
import time
from pathlib import Path

import pytest
import torch

# Without a GPU, megarl's Triton kernels (megarl/models/kernels.py) run under Triton's interpreter. Triton reads
# this when its language module is imported, which torch.compile does too: before any test imports anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def pytest_collection_modifyitems(items):
    """The modules that use `ray_local` run last, one after another on each worker, so that one Ray serves them all
    (starting and stopping one took 5-12 s of each module on 2 cores); the other modules keep their order, before
    them (some start and stop a Ray of their own, which a running one would refuse).

    Under pytest-xdist (scripts/test.sh runs two workers) tests that start Ray, trainers or scripts run beside each
    other: each worker's `ray_local` is a local Ray of its own, and a test finds the processes it started by a marker
    of its own, never by counting the machine's. A module's tests stay on one worker (scripts/test.sh: loadscope, in
    this order), so its module-scoped fixtures are built once."""
    uses_ray = {item.getparent(pytest.Module) for item in items if "ray_local" in item.fixturenames}
    items.sort(key=lambda item: item.getparent(pytest.Module) in uses_ray)  # stable: order kept within each part


@pytest.fixture(scope="session")
def _ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """A local Ray with logical CPUs for the trainer's actors; one torch thread each. The modules that use it share
    one; a module that leaves CPUs held (an actor or placement group it did not end) stops it, and the next module
    starts a fresh one, as each did before."""
    import ray

    if not ray.is_initialized():
        # "local": a bare ray.init() joins the cluster that any `ray start` on this machine recorded (a stale record
        # too), and then refuses num_cpus
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    yield
    deadline = time.monotonic() + 10  # killed actors give their CPUs back a moment later
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            ray.shutdown()
            break
        time.sleep(0.1)
