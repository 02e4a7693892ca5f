"""Where metrics go: `Tracker(output_dir, ["console", "tensorboard", "jsonl"], config).log(metrics, step)`.

Metric names are slash-separated (`train/reward`, `val/reward`, `timing/generate`, `perf/tokens_per_s`);
TensorBoard groups scalars by the part before the slash. A logger is a class built as
`cls(output_dir, config)` with `log(metrics, step)` and `close()`; users add one with
`@LOGGERS.register("name")` or name it as `module:Class`. Re-using an output_dir appends to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

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

    def close(self) -> None:
        self.file.close()


class Tracker:
    def __init__(self, output_dir: str, loggers: list[str], config: dict | None = None):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        classes = [LOGGERS.get(name) for name in loggers]  # an unknown name fails before anything is opened
        self.loggers = [cls(output_dir, config) for cls in classes]
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
