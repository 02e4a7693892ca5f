"""The wandb, mlflow and swanlab loggers: scalars in each library's local files, read back with its own reader, with
no connection off the machine; a missing library or an unknown logger is a ConfigError that says the fix."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError
from megarl.utils.tracking import Tracker, check_loggers, run_dir

from tests.conftest import QUICKSTART

TRACKERS = ["wandb", "mlflow", "swanlab"]
# the warm start's steps come before RL's step 0, as in a run (W&B refuses a step below the last one); MLflow
# refuses '@' in a name (val/mean@4: mean over 4 samples), which its logger writes as '_'
STEPS = [(1, {"sft/loss": 2.5}), (2, {"sft/loss": 1.75}), (0, {"val/reward": 0.125, "val/mean@4": 0.25}),
         (1, {"train/reward": 0.5, "train/kl": 0.001}),
         (2, {"train/reward": 0.75, "train/kl": -1e-05, "val/reward": 0.375})]
SCALARS = sorted((name, step, value) for step, metrics in STEPS for name, value in metrics.items())
CONFIG = {"trainer": {"project_name": "proj", "experiment_name": "exp", "loggers": ["console"]},
          "algorithm": {"kl_coef": 0.01}, "reward": {"name": "r" * 7000}}

# Runs in a process of its own (each library's global state stays there, and a hang is killed): every connection or
# name lookup off this machine is written to reached.json, after the libraries' own exit handlers have run.
LOG_STEPS = """
import atexit, json, sys
reached = []
def audit(event, args):
    host = args[1][0] if event == "socket.connect" and isinstance(args[1], tuple) else (
        args[0] if event == "socket.getaddrinfo" else None)
    if host not in (None, "localhost", "127.0.0.1", "::1", b"localhost", b"127.0.0.1"):
        reached.append(f"{event} {host}")
sys.addaudithook(audit)
atexit.register(lambda: open(sys.argv[1] + "/reached.json", "w").write(json.dumps(reached)))
from megarl.utils.tracking import Tracker
with Tracker(sys.argv[1], [sys.argv[2]], json.loads(sys.argv[3])) as tracker:
    for step, metrics in json.loads(sys.argv[4]):
        tracker.log(metrics, step)
"""


@pytest.fixture(autouse=True)
def mlflow_env(monkeypatch):
    """This process reads MLflow's file store (refused without the first) and sends MLflow no telemetry."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def offline_env(tmp_path: Path) -> dict:
    """This environment without the trackers' own variables (their defaults are what is tested) and with a home of
    its own (no login or settings file of this machine's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "SWANLAB_"))}
    (tmp_path / "home").mkdir(exist_ok=True)
    return env | {"HOME": str(tmp_path / "home")}


def run(args: list[str], tmp_path: Path, timeout: float) -> None:
    done = subprocess.run(args, env=offline_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def wandb_run(out: Path) -> dict:
    """W&B's own reader of the offline run's transaction log (`wandb leet inspect --json`)."""
    [run_dir] = (out / "wandb").glob("offline-run-*")
    lines = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                           capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    records = [json.loads(line) for line in lines]
    [start] = [r["run"] for r in records if r["type"] == "run"]
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    return {"project": start["project"], "name": start["display_name"], "config": start["config"]["update"],
            "scalars": sorted((k, row["step"], v) for row in rows for k, v in row.items() if "/" in k)}


def mlflow_run(out: Path) -> dict:
    """MLflow's client on the file store in out/mlruns: the one experiment the run made, and its run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
    [found] = client.search_runs([experiment.experiment_id])
    names = found.data.metrics  # the last value of each
    return {"project": experiment.name, "name": found.info.run_name, "status": found.info.status,
            "params": found.data.params,
            "scalars": sorted((k, m.step, m.value) for k in names
                              for m in client.get_metric_history(found.info.run_id, k))}


def as_mlflow_names(scalars: list[tuple]) -> list[tuple]:
    return sorted((name.replace("@", "_"), step, value) for name, step, value in scalars)


def swanlab_run(out: Path) -> dict:
    """SwanLab's reader of the run's record file (the run's own columns, not its system monitor's), and the config
    it saved."""
    from swanlab.proto.swanlab.metric.column.v1.column_pb2 import ColumnClass
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    [run_file] = (out / "swanlog").glob("run-*/run-*.swanlab")
    reader, records = DataStoreReader(), []
    reader.open(run_file)
    for data in reader:
        records.append(Record())
        records[-1].ParseFromString(data)
    reader.close()
    [start] = [r.start for r in records if r.HasField("start")]
    ours = {r.column.column_key for r in records
            if r.HasField("column") and r.column.column_class == ColumnClass.COLUMN_CLASS_CUSTOM}
    scalars = [r.scalar for r in records if r.HasField("scalar") and r.scalar.key in ours]
    config = yaml.safe_load((run_file.parent / "files" / "config.yaml").read_text())
    return {"project": start.project, "name": start.name, "config": {k: v["value"] for k, v in config.items()},
            "scalars": sorted((s.key, s.step, s.value.number) for s in scalars)}


@pytest.mark.parametrize("logger", TRACKERS)
def test_tracker_files_hold_the_logged_scalars_offline(tmp_path, logger):
    out = tmp_path / "out"
    run([sys.executable, "-c", LOG_STEPS, str(out), logger, json.dumps(CONFIG), json.dumps(STEPS)], tmp_path,
        timeout=120)  # ~5-15 s on 2 busy cores
    assert json.loads((out / "reached.json").read_text()) == []  # nothing off this machine, not even a lookup
    got = {"wandb": wandb_run, "mlflow": mlflow_run, "swanlab": swanlab_run}[logger](out)
    expected = as_mlflow_names(SCALARS) if logger == "mlflow" else SCALARS
    assert (got["project"], got["name"], got["scalars"]) == ("proj", "exp", expected)
    if logger == "mlflow":
        assert got["status"] == "FINISHED"
        assert got["params"]["algorithm.kl_coef"] == "0.01" and got["params"]["trainer.loggers"] == "['console']"
        assert got["params"]["reward.name"] == "r" * 6000  # MLflow's limit on a param's length
    else:
        assert got["config"]["algorithm"] == {"kl_coef": 0.01} and got["config"]["reward"] == {"name": "r" * 7000}


def test_names_default_to_megarl_and_the_output_directory(tmp_path, monkeypatch):
    out, store = tmp_path / "my_run", tmp_path / "store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (store / "mlruns").as_uri())  # honoured over output_dir/mlruns
    with Tracker(str(out), ["mlflow"], {"trainer": {"project_name": "", "experiment_name": ""}}) as tracker:
        tracker.log({"train/reward": 1.0}, 3)
    assert not (out / "mlruns").exists()
    got = mlflow_run(store)
    assert (got["project"], got["name"], got["scalars"]) == ("megarl", "my_run", [("train/reward", 3, 1.0)])


@pytest.mark.parametrize("logger", TRACKERS)
def test_a_missing_library_is_named_with_its_install_command(tmp_path, logger, monkeypatch):
    monkeypatch.setitem(sys.modules, logger, None)  # as if not installed: its import fails
    message = rf"trainer.loggers: '{logger}' needs the {logger} package: pip install 'megarl\[trackers\]'"
    with pytest.raises(ConfigError, match=message):
        check_loggers(["console", logger])
    with pytest.raises(ConfigError, match=message):
        Tracker(str(tmp_path), ["jsonl", logger])
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing opened before the error


def test_unknown_logger_lists_the_valid_ones():
    check_loggers(["console", "tensorboard", "jsonl", *TRACKERS])  # installed: no error
    with pytest.raises(ConfigError, match=r"trainer.loggers: unknown logger 'wandbb'; did you mean 'wandb'\? "
                                          r"valid names: console, jsonl, mlflow, swanlab, tensorboard, wandb"):
        check_loggers(["console", "wandbb"])
    with pytest.raises(ConfigError, match=r"trainer.loggers: logger 'no_such_module:Logger': cannot import"):
        check_loggers(["no_such_module:Logger"])


def test_a_run_writes_every_scalar_to_every_tracker(tmp_path):
    """python -m megarl.train with the three trackers: each holds every scalar metrics.jsonl has, at its step: the
    held-out reward before RL and after the last step, the warm start's steps logged before them."""
    out = tmp_path / "run"
    run([sys.executable, "-m", "megarl.train", "--config", str(QUICKSTART), f"trainer.output_dir={out}",
         "trainer.loggers=[console,jsonl,mlflow,wandb,swanlab]", "trainer.steps=2", "sft.steps=2",
         "data.prompts_per_step=4", "rollout.n_samples=4", "data.val_size=8", "rollout.eval_n_samples=1",
         "actor.parallel.world_size=1", "actor.parallel.tp=1", "model.tiny_num_layers=1"],
        tmp_path, timeout=300)  # ~40 s alone on 2 cores
    logs = run_dir(out)  # the run's own directory under the output root, named by its id
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    scalars = sorted((k, row["step"], v) for row in rows for k, v in row.items() if k != "step")
    assert [step for k, step, _ in scalars if k == "val/reward"] == [0, 2]
    assert [step for k, step, _ in scalars if k == "sft/loss"] == [1, 2]
    for got, expected in ((wandb_run(logs), scalars), (mlflow_run(logs), as_mlflow_names(scalars)),
                          (swanlab_run(logs), scalars)):
        assert (got["project"], got["name"], got["scalars"]) == ("megarl", f"run-{logs.name}", expected)
