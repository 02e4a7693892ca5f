"""Where metrics go: `Tracker(output_dir, ["console", "tensorboard", "jsonl"], config).log(metrics, step)`.

Metric names are slash-separated (`train/reward`, `val/reward`, `timing/generate`, `perf/tokens_per_s`);
TensorBoard groups scalars by the part before the slash. A logger is a class built as
`cls(output_dir, config)` with `log(metrics, step)` and `close()`; users add one with
`@LOGGERS.register("name")` or name it as `module:Class`. Re-using an output_dir appends to it.

wandb, mlflow and swanlab need their libraries (`pip install 'megarl[trackers]'`, imported only when named) and
write to files under output_dir unless their own environment variable names a server: no run needs a network.
Each files the run under trainer.project_name as trainer.experiment_name (default: output_dir's last part).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import yaml

from megarl.config import ConfigError
from megarl.utils.registry import Registry

LOGGERS = Registry("logger")


@LOGGERS.register("console")
class ConsoleLogger:
    """One compact line per step with the headline numbers that are present, e.g.
    `step 3 | reward 0.512 | val 0.6 | kl 0.0012 | entropy 1.23 | len 12.5 | 3.21s | 1520 tok/s`."""

    # (metric name, label, format); fields whose metric is absent are left out of the line
    FIELDS = [("sft/loss", "sft loss", "{:.4g}"), ("train/reward", "reward", "{:.4g}"),
              ("val/reward", "val", "{:.4g}"), ("val/accuracy", "val exact", "{:.3g}"), ("train/kl", "kl", "{:.4g}"),
              ("train/entropy", "entropy", "{:.4g}"), ("train/response_length", "len", "{:.4g}"),
              ("rm/loss", "rm loss", "{:.4g}"), ("rm/accuracy", "acc", "{:.3g}"),
              ("val/pair_accuracy", "val acc", "{:.3g}"), ("val/margin", "val margin", "{:.3g}"),
              ("timing/step", "", "{:.3g}s"), ("perf/tokens_per_s", "", "{:.0f} tok/s")]

    def __init__(self, output_dir: str, config: dict | None):
        pass

    def line(self, metrics: dict[str, float], step: int) -> str:
        parts = [f"step {step}"]
        for key, label, fmt in self.FIELDS:
            if key in metrics:
                parts.append(f"{label} {fmt.format(metrics[key])}".strip())
        return " | ".join(parts)

    def log(self, metrics: dict[str, float], step: int) -> None:
        print(self.line(metrics, step), flush=True)

    def close(self) -> None:
        pass


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    """Event files in output_dir: every metric as a scalar under its own name, the config as text."""

    def __init__(self, output_dir: str, config: dict | None):
        from torch.utils.tensorboard import SummaryWriter  # imported here: only this logger needs it

        self.writer = SummaryWriter(log_dir=output_dir)
        if config is not None:
            # indented by four spaces: TensorBoard renders text as Markdown, and this keeps it verbatim
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "".join(f"    {line}" for line in text.splitlines(True)), 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crashed run keeps every logged step

    def close(self) -> None:
        self.writer.close()


@LOGGERS.register("jsonl")
class JsonlLogger:
    """output_dir/metrics.jsonl: one JSON object per log call, {"step": N, <name>: value, ...}."""

    def __init__(self, output_dir: str, config: dict | None):
        self.file = open(Path(output_dir) / "metrics.jsonl", "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN/inf are written as bare NaN/Infinity, which Python's json reads back
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def rewind(self, step: int) -> None:
        """A run resumed after `step` redoes the steps after it: the rows logged after the last row of `step` (by the
        stopped run) are cut, so the redone steps replace them. Cut here rather than left for readers to deduplicate:
        a killed run may leave a half-written last row, which the next row appended would turn into an invalid line
        (it is cut too), and the warm start's step numbers overlap RL's, so no reader could deduplicate by step.
        Written whole beside the file and renamed over it: a crash meanwhile leaves one of the two, each valid."""
        path = Path(self.file.name)
        self.file.close()

        def step_of(line: str):
            try:
                return json.loads(line).get("step")
            except ValueError:
                return None

        lines = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
        ends = [i for i, line in enumerate(lines) if step_of(line) == step]
        temp = path.with_name(path.name + ".tmp")
        temp.write_text("".join(lines[:ends[-1] + 1] if ends else lines))
        os.replace(temp, path)
        self.file = open(path, "a")

    def close(self) -> None:
        self.file.close()


@LOGGERS.register("wandb")
class WandbLogger:
    """Weights & Biases, offline unless WANDB_MODE says otherwise: output_dir/wandb/offline-run-*/, the config as
    the run's config. `wandb leet <output_dir>/wandb` shows it in the terminal, `wandb sync <run dir>` uploads it."""

    package = "wandb"

    def __init__(self, output_dir: str, config: dict | None):
        # in the environment, not as init's argument: W&B's own telemetry starts before init reads its arguments,
        # and reaches for W&B's server unless the process is offline
        os.environ["WANDB_MODE"] = os.environ.get("WANDB_MODE") or "offline"
        import wandb

        project, name = run_names(output_dir, config)
        # create_new: another run open in this process (another Tracker's) stays open
        self.run = wandb.init(dir=output_dir, project=project, name=name, config=config, reinit="create_new")
        # W&B drops a row whose step is below the last row's, and the warm start's steps come before RL's step 0:
        # so every metric is charted against a `step` metric of its own, and W&B's step counts the log calls
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def close(self) -> None:
        self.run.finish()


@LOGGERS.register("mlflow")
class MLflowLogger:
    """MLflow: a run in the experiment trainer.project_name of the store MLFLOW_TRACKING_URI names, else of a file
    store in output_dir/mlruns; the config as the run's params, one per dotted key. The UI is full mlflow's
    (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri <output_dir>/mlruns`)."""

    package = "mlflow"

    def __init__(self, output_dir: str, config: dict | None):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(output_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
        # its usage telemetry posts to mlflow.org from a thread that the process's exit waits for
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        project, name = run_names(output_dir, config)
        self.client, self.metric, self.batch = MlflowClient(uri), Metric, MAX_METRICS_PER_BATCH
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(_mlflow_name(k), str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in _flatten(config or {}).items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        rows = [self.metric(_mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), self.batch):  # a MoE model's expert loads are thousands of metrics
            self.client.log_batch(self.run_id, metrics=rows[i:i + self.batch])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@LOGGERS.register("swanlab")
class SwanLabLogger:
    """SwanLab, offline unless SWANLAB_MODE says otherwise: output_dir/swanlog/run-*/, the config as the run's
    config. `swanlab sync <run dir>` uploads it; SWANLAB_MODE=local also feeds `swanlab watch <output_dir>/swanlog`
    (its dashboard: pip install 'swanlab[dashboard]')."""

    package = "swanlab"

    def __init__(self, output_dir: str, config: dict | None):
        import swanlab

        project, name = run_names(output_dir, config)
        self.run = swanlab.init(log_dir=str(Path(output_dir) / "swanlog"), project=project, name=name, config=config,
                                mode=os.environ.get("SWANLAB_MODE") or "offline")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def run_names(output_dir: str, config: dict | None) -> tuple[str, str]:
    """The trackers' project and run name: trainer.project_name and trainer.experiment_name, by default megarl
    and the last part of output_dir."""
    trainer = (config or {}).get("trainer", {})
    return trainer.get("project_name") or "megarl", trainer.get("experiment_name") or Path(output_dir).resolve().name


def check_loggers(names: list[str]) -> None:
    """Each of trainer.loggers a logger whose library is installed; else a ConfigError naming it and the fix."""
    for name in names:
        try:
            cls = LOGGERS.get(name)
        except (KeyError, ImportError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"trainer.loggers: {e}") from None
        package = getattr(cls, "package", None)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.loggers: '{name}' needs the {package} package: pip install 'megarl[trackers]'")


class Tracker:
    def __init__(self, output_dir: str, loggers: list[str], config: dict | None = None):
        check_loggers(loggers)  # an unknown name or a missing library fails before anything is opened
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.loggers = [LOGGERS.get(name)(output_dir, config) for name in loggers]
        self.closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalar metrics (numbers, or one-element tensors/arrays) at `step`."""
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        for logger in self.loggers:
            logger.log(values, step)

    def close(self) -> None:
        if not self.closed:
            for logger in self.loggers:
                logger.close()
            self.closed = True

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _scalar(name: str, value) -> float:
    """A number, or a one-element tensor/array, as a float; anything else names the metric."""
    if not isinstance(value, str):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"metric '{name}' must be a number, got {type(value).__name__}: {value!r:.80}")


def _flatten(config: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; other values (lists included) are leaves."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _mlflow_name(name: str) -> str:
    """MLflow takes letters, digits and _ - . / : and space in a metric's or param's name; anything else -> _."""
    return re.sub(r"[^\w\-./: ]", "_", name)
