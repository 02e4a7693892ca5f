"""Fixtures shared by the tests that run the whole system through Ray."""

from pathlib import Path

import pytest

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray with logical CPUs for the trainer's actors; one torch thread each."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
    yield
    ray.shutdown()
