"""Known third-party warnings are filtered in the processes a run starts; --verbose shows them."""

import os
import subprocess
import sys
import textwrap

import pytest

from megarl.utils import quiet

# what a worker of the run does: megarl imported first (as unpickling a Ray actor's class or `python -m
# megarl.rewards.worker` does), then megatron's and transformers' warnings as they word them, and one unknown
WORKER = textwrap.dedent("""
    import logging, warnings
    import megarl
    from megarl.utils import quiet
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
    logging.getLogger("transformers.tokenization_utils_base").warning(
        "Token indices sequence length is longer than the specified maximum sequence length for this model "
        "(600 > 512). Running this sequence through the model will result in indexing errors")
    quiet.filter_gpu_advice()  # a CPU training rank
    warnings.warn("When using async grad allreduce it is recommended to set the environment variable "
                  "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
    warnings.warn("a warning megarl does not know")
""")

# a driver: the entry point's arguments parsed and quiet installed as main() does, then a worker started
DRIVER = textwrap.dedent("""
    import subprocess, sys
    from megarl.train import main
    assert main(sys.argv[1:] + ["--check-config", "--config", "configs/quickstart.yaml"]) == 0
    sys.exit(subprocess.run([sys.executable, "-c", {worker!r}]).returncode)
""").format(worker=WORKER)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_driver(*flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != quiet.ENV}
    done = subprocess.run([sys.executable, "-c", DRIVER, *flags], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_known_warnings_are_filtered_in_a_process_the_run_starts():
    stderr = run_driver()
    assert "a warning megarl does not know" in stderr
    for known in ("Apex", "indexing errors", "CUDA_DEVICE_MAX_CONNECTIONS"):
        assert known not in stderr


def test_verbose_shows_them():
    stderr = run_driver("--verbose")
    for shown in ("Apex is not installed", "Transformer Engine and Apex", "indexing errors",
                  "CUDA_DEVICE_MAX_CONNECTIONS", "a warning megarl does not know"):
        assert shown in stderr


def test_a_process_megarl_did_not_start_keeps_every_warning(monkeypatch):
    monkeypatch.delenv(quiet.ENV, raising=False)
    quiet.apply()
    with pytest.warns(UserWarning, match="Apex is not installed"):
        import warnings
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
    assert quiet.env() == {}


def test_ray_actors_are_given_the_setting(monkeypatch):
    monkeypatch.setenv(quiet.ENV, "0")
    assert quiet.env() == {quiet.ENV: "0"}  # the runtime_env of every actor (workers/group.py)
