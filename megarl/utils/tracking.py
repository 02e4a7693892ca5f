"""Where metrics go: `Tracker(log_dir, ["console", "tensorboard", "jsonl"], config).log(metrics, step)`.

A run logs into a directory of its own under the output root, `<trainer.output_dir>/logs/<run id>/` (`run_dir`):
its metrics.jsonl, TensorBoard event files and trackers' offline files, so that runs sharing an output root stay
apart (`tensorboard --logdir <output_dir>` shows each as a run of its own). A fresh run gets a new id (`new_run_id`:
its start, UTC, and a random suffix, so ids sort by start); a resumed run keeps its checkpoint's id and continues its
own files, cut back to the resumed step first (`Tracker.rewind`).

Metric names are slash-separated (`train/reward`, `val/reward`, `timing/generate`, `perf/tokens_per_s`);
TensorBoard groups scalars by the part before the slash. A logger is a class built as
`cls(log_dir, config)` with `log(metrics, step)` and `close()`, and `rewind(step)` where it keeps what it logged;
users add one with `@LOGGERS.register("name")` or name it as `module:Class`.

wandb, mlflow and swanlab need their libraries (`pip install 'megarl[trackers]'`, imported only when named) and
write to files under log_dir unless their own environment variable names a server: no run needs a network.
Each files the run under trainer.project_name as `<experiment>-<run id>` (experiment: trainer.experiment_name, by
default the output root's last part).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Iterator

import yaml

from megarl.config import ConfigError
from megarl.utils.progress import Progress, duration, write
from megarl.utils.registry import Registry

LOGGERS = Registry("logger")
LOGS = "logs"  # <output_dir>/logs/<run id>/: each run's metrics, events and trackers' files


@LOGGERS.register("console")
class ConsoleLogger:
    """One compact line per step with the headline numbers that are present, e.g.
    `step 3/120 | reward 0.512 | val 0.6 | kl 0.0012 | entropy 1.23 | len 12.5 | 3.21s | 1520 tok/s | ETA 04:10`:
    the total and ETA from the Progress that the Tracker follows (Tracker.steps), without one `step 3`. With
    `every_s`, a line at most every that many seconds, and always for a step that evaluated (val/*), the phase's
    first step and its last: a run of thousands of short steps prints a line per interval."""

    # (metric name, label, format); fields whose metric is absent are left out of the line
    FIELDS = [("sft/loss", "sft loss", "{:.4g}"), ("train/reward", "reward", "{:.4g}"),
              ("val/reward", "val", "{:.4g}"), ("val/accuracy", "val exact", "{:.3g}"), ("train/kl", "kl", "{:.4g}"),
              ("train/entropy", "entropy", "{:.4g}"), ("train/response_length", "len", "{:.4g}"),
              ("rm/loss", "rm loss", "{:.4g}"), ("rm/accuracy", "acc", "{:.3g}"),
              ("val/pair_accuracy", "val acc", "{:.3g}"), ("val/margin", "val margin", "{:.3g}"),
              ("timing/step", "", "{:.3g}s"), ("perf/tokens_per_s", "", "{:.0f} tok/s"),
              ("restart/count", "restart", "{:.0f}"), ("restart/seconds_lost", "lost", "{:.3g}s")]

    def __init__(self, log_dir: str, config: dict | None):
        self.progress: Progress | None = None
        self.every_s: float | None = None
        self.last_line = 0.0

    def follow(self, progress: Progress | None, every_s: float | None = None) -> None:
        self.progress, self.every_s = progress, every_s

    def line(self, metrics: dict[str, float], step: int) -> str:
        p = self.progress
        parts = [f"{p.label} {step}/{p.total}" if p is not None else f"step {step}"]
        for key, label, fmt in self.FIELDS:
            if key in metrics:
                parts.append(f"{label} {fmt.format(metrics[key])}".strip())
        eta = p.eta() if p is not None and step < p.total else None
        return " | ".join(parts + ([f"ETA {duration(eta)}"] if eta is not None else []))

    def due(self, metrics: dict[str, float], step: int) -> bool:
        p = self.progress
        if p is None or not self.every_s or step in (p.first + 1, p.total):
            return True
        if any(name.startswith("val/") for name in metrics):  # an evaluation's numbers are always shown
            return True
        return time.monotonic() - self.last_line >= self.every_s

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.due(metrics, step):
            self.last_line = time.monotonic()
            write(self.line(metrics, step))

    def close(self) -> None:
        pass


@LOGGERS.register("tensorboard")
class TensorBoardLogger:
    """Event files in log_dir: every metric as a scalar under its own name, the config as text (at step 0)."""

    def __init__(self, log_dir: str, config: dict | None):
        from torch.utils.tensorboard import SummaryWriter  # imported here: only this logger needs it

        self.directory = Path(log_dir)
        self.writer = SummaryWriter(log_dir=log_dir)
        if config is not None:
            # indented by four spaces: TensorBoard renders text as Markdown, and this keeps it verbatim
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "".join(f"    {line}" for line in text.splitlines(True)), 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crashed run keeps every logged step

    def rewind(self, step: int) -> None:
        """As JsonlLogger.rewind: the events logged after the last one of `step` are cut, so that TensorBoard shows
        one value per step for the redone steps. Not TensorBoard's own purge (SummaryWriter's purge_step): that hides
        every event past the step, the warm start's too, whose step numbers overlap RL's. The config text is not
        logged again: the first one stays the run's."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        cut_events(self.directory, step)
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def close(self) -> None:
        self.writer.close()


def cut_events(directory: Path, step: int) -> None:
    """The event files in `directory` as one, holding the events up to the last one of `step` (all of them when
    none is of `step`). A record half-written by a killed run is dropped. Written beside under a name TensorBoard
    does not read, then renamed over the first file and the others removed: a resumed run's files are one file and
    the one its last process opened, so a crash leaves either the old events or the cut ones, never both."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    files = sorted(directory.glob("*tfevents*"))  # by name: their creation time, as TensorBoard orders them
    if not files:
        return
    records = [record for path in files for record in RawEventFileLoader(str(path)).Load()]
    ends = [i for i, record in enumerate(records) if (e := Event.FromString(record)).step == step and e.summary.value]
    temp = directory / ".events.rewind"
    with open(temp, "wb") as f:
        writer = RecordWriter(f)
        for record in records[:ends[-1] + 1] if ends else records:
            writer.write(record)
    os.replace(temp, files[0])
    for path in files[1:]:
        path.unlink()


@LOGGERS.register("jsonl")
class JsonlLogger:
    """log_dir/metrics.jsonl: one JSON object per log call, {"step": N, <name>: value, ...}."""

    def __init__(self, log_dir: str, config: dict | None):
        self.file = open(Path(log_dir) / "metrics.jsonl", "a")

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
    """Weights & Biases, offline unless WANDB_MODE says otherwise: log_dir/wandb/offline-run-*/, the config as
    the run's config. `wandb leet <log_dir>/wandb` shows it in the terminal, `wandb sync <run dir>` uploads it."""

    package = "wandb"

    def __init__(self, log_dir: str, config: dict | None):
        # in the environment, not as init's argument: W&B's own telemetry starts before init reads its arguments,
        # and reaches for W&B's server unless the process is offline
        os.environ["WANDB_MODE"] = os.environ.get("WANDB_MODE") or "offline"
        import wandb

        project, name = run_names(log_dir, config)
        # create_new: another run open in this process (another Tracker's) stays open
        self.run = wandb.init(dir=log_dir, project=project, name=name, config=config, reinit="create_new")
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
    store in log_dir/mlruns; the config as the run's params, one per dotted key. The UI is full mlflow's
    (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri <log_dir>/mlruns`)."""

    package = "mlflow"

    def __init__(self, log_dir: str, config: dict | None):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(log_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
        # its usage telemetry posts to mlflow.org from a thread that the process's exit waits for
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        project, name = run_names(log_dir, config)
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
    """SwanLab, offline unless SWANLAB_MODE says otherwise: log_dir/swanlog/run-*/, the config as the run's
    config. `swanlab sync <run dir>` uploads it; SWANLAB_MODE=local also feeds `swanlab watch <log_dir>/swanlog`
    (its dashboard: pip install 'swanlab[dashboard]')."""

    package = "swanlab"

    def __init__(self, log_dir: str, config: dict | None):
        import swanlab

        project, name = run_names(log_dir, config)
        self.run = swanlab.init(log_dir=str(Path(log_dir) / "swanlog"), project=project, name=name, config=config,
                                mode=os.environ.get("SWANLAB_MODE") or "offline")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def run_names(log_dir: str, config: dict | None) -> tuple[str, str]:
    """The trackers' project and run name: trainer.project_name (default megarl), and the experiment followed by
    the run id where the config names one (`run_id`, as the trainers' does): `<experiment>-<run id>`, so that the
    runs of one output root are told apart and a resumed run keeps its name. The experiment is
    trainer.experiment_name, by default the last part of trainer.output_dir (else of log_dir)."""
    config = config or {}
    trainer = config.get("trainer", {})
    experiment = trainer.get("experiment_name") or Path(trainer.get("output_dir") or log_dir).resolve().name
    run_id = config.get("run_id")
    return trainer.get("project_name") or "megarl", f"{experiment}-{run_id}" if run_id else experiment


def new_run_id() -> str:
    """A fresh run's id: its start (UTC, to the second) and a random suffix, e.g. 20261206-225102-3f9a; ids sort by
    start."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def run_dir(output_dir: str | Path, run_id: str | None = None) -> Path:
    """The directory run `run_id` of an output root logs into; without an id, the newest run's (the last to start)
    or a FileNotFoundError naming the root."""
    logs = Path(output_dir) / LOGS
    if run_id is not None:
        return logs / run_id
    runs = sorted(p.name for p in logs.glob("*") if p.is_dir()) if logs.is_dir() else []
    if not runs:
        raise FileNotFoundError(f"{output_dir} holds no run's logs ({logs} has no run directory)")
    return logs / runs[-1]


def run_metrics(output_dir: str | Path) -> Path:
    """The newest run's metrics.jsonl under an output root; where no run has logged there, a path that does not
    exist (<output_dir>/logs/metrics.jsonl, which no run writes), for readers that check first."""
    try:
        return run_dir(output_dir) / "metrics.jsonl"
    except FileNotFoundError:
        return Path(output_dir) / LOGS / "metrics.jsonl"


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
    def __init__(self, log_dir: str | Path, loggers: list[str], config: dict | None = None):
        check_loggers(loggers)  # an unknown name or a missing library fails before anything is opened
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.directory = Path(log_dir)
        self.loggers = [LOGGERS.get(name)(str(log_dir), config) for name in loggers]
        self.progress: Progress | None = None
        self.closed = False

    @contextlib.contextmanager
    def steps(self, desc: str, total: int, done: int = 0, label: str = "step",
              every_s: float | None = None) -> Iterator[Progress]:
        """A phase of `total` logged steps (`done` of them finished before: a resumed run's): a bar on a terminal,
        and the console's lines say `<label> N/T` and the ETA; every_s: the console's interval between lines
        (None: every logged step). Each log call moves the bar to its step; the loop may move it between calls."""
        self.progress = Progress(desc, total, done=done, label=label, every_s=None)  # the console's lines say it
        self._follow(self.progress, every_s)
        try:
            yield self.progress
        finally:
            self.progress.close()
            self.progress = None
            self._follow(None)

    def _follow(self, progress: Progress | None, every_s: float | None = None) -> None:
        for logger in self.loggers:
            if isinstance(logger, ConsoleLogger):
                logger.follow(progress, every_s)

    def stage(self, name: str) -> None:
        """The stage the current step is in, on the bar (a terminal's)."""
        if self.progress is not None:
            self.progress.stage(name)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalar metrics (numbers, or one-element tensors/arrays) at `step`."""
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        if self.progress is not None:
            self.progress.set(step)
        for logger in self.loggers:
            logger.log(values, step)

    def rewind(self, step: int) -> None:
        """A resumed run redoes the steps after `step`: each logger that keeps what it logged cuts what came after
        (JsonlLogger.rewind, TensorBoardLogger.rewind)."""
        for logger in self.loggers:
            if hasattr(logger, "rewind"):
                logger.rewind(step)

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
