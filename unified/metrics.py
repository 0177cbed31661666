"""Per-step metrics: record values during a step, reduce each name to one number, write them out.

`MetricsAggregator` collects what the trainer records during one optimizer step, `flush()` reduces
each name by a rule read from the name itself (sum, max, min, last or mean), and `log()` hands the
result to every `MetricsSink`: the console progress line, `metrics.jsonl`, TensorBoard and W&B.
The names in `METRIC_NAMES` are a contract shared by all sinks and by `unified plot`. Importing this
module never imports torch, tensorboard or wandb; a sink imports its library when it is built.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import numpy as np

from unified.config import LoggingConfig, TrainerConfig
from unified.errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run

__all__ = [
    "METRIC_NAMES",
    "ConsoleSink",
    "JsonlSink",
    "MetricValue",
    "MetricsAggregator",
    "MetricsSink",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "counted_quantile",
    "metrics_for",
]

METRIC_NAMES: tuple[str, ...] = (
    "step",
    "policy/version",
    "reward/mean",
    "reward/std",
    "train/loss",
    "train/kl_sample_train",
    "train/entropy",
    "staleness/mean",
    "staleness/max",
    "groups/trained",
    "groups/filtered",
    "episodes/errors",
    "episodes/timeouts",
    "groups/requeued",
    "episodes/discarded",
    "episodes/cancelled",
    "tokens/generated",
    "tokens/trained",
    "tokens/discarded",
    "length/trained_over_generated",
    "lag/token_mean",
    "lag/token_p99",
    "lag/token_max",
    "train/skipped_steps",
    "time/step",
    "time/generate",
    "time/train",
    "time/sync",
    "throughput/tokens_per_s",
    "trainer/idle_ratio",
    "rollout/idle_ratio",
    "rollout/engine_idle_ratio",
    "eval/accuracy",
)


MetricValue = float | np.integer[Any] | np.floating[Any] | np.bool_
"""What `MetricsAggregator.record` accepts: a Python or numpy real number (bool counts as 0/1)."""


class MetricsSink(Protocol):
    """Where one step's reduced metrics go: `write` once per step, `close` once at the end."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _nan_if_any(reduce: Callable[[list[float]], float]) -> Callable[[list[float]], float]:
    # Python's max/min answer depends on where a NaN sits in the list; make NaN always win.
    return lambda values: math.nan if any(math.isnan(v) for v in values) else reduce(values)


def _fsum(values: list[float]) -> float:
    """`math.fsum`, or the plain sum where fsum raises (+inf with -inf: nan; an overflow: inf)."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):
        return sum(values)


_SUM = _nan_if_any(_fsum)
_MAX = _nan_if_any(max)
_MIN = _nan_if_any(min)
_MEAN = _nan_if_any(lambda values: _fsum(values) / len(values))


def _last(values: list[float]) -> float:
    return values[-1]


def _std(values: list[float]) -> float:
    """Population standard deviation of the values recorded under a `.../std` key."""
    mean = _fsum(values) / len(values)
    return math.sqrt(_fsum([(v - mean) * (v - mean) for v in values]) / len(values))  # no **:
    # a float's ** raises on overflow where * gives inf


def counted_quantile(counts: Mapping[int, int], quantile: float) -> int:
    """The smallest value that `quantile` of the counted items do not exceed (`counts`: value
    -> how many items have it; not empty): the p99 of a token lag, from a count per lag."""
    total, seen = sum(counts.values()), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= quantile * total:
            return value
    return max(counts)


def _reduction(key: str) -> Callable[[list[float]], float]:
    """How `key` reduces, read from its name: counts add, extremes stay extreme, rest average."""
    if key.startswith(("groups/", "episodes/", "tokens/")) or key.endswith(("/count", "/tokens")):
        return _SUM
    if key.endswith("/max"):
        return _MAX
    if key.endswith("/min"):
        return _MIN
    if key.endswith("/std"):
        return _std
    if key in ("step", "policy/version") or key.startswith("progress/"):
        return _last
    return _MEAN


def _as_float(key: str, value: object) -> float:
    # numbers.Real covers bool, int, float and numpy's integer and floating scalars.
    if isinstance(value, numbers.Real | np.bool_):
        return float(value)
    raise TypeError(
        f"metric {key!r} must be a real number (bool, int, float or numpy scalar), "
        f"got {type(value).__name__}: {value!r}"
    )


def _close_all(sinks: Iterable[MetricsSink]) -> None:
    """Close every sink, even after one raises; then re-raise the first error."""
    first_error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as e:
            if first_error is None:
                first_error = e
    if first_error is not None:
        raise first_error


class MetricsAggregator:
    """Collects values recorded during one step and reduces them to one number per key.

    The trainer calls `record` as results arrive, `flush` at the end of the step, then `log` (via
    `asyncio.to_thread`, since sinks do blocking I/O) with the flushed dict, and `close` once.
    """

    def __init__(self, sinks: Sequence[MetricsSink] = ()) -> None:
        self._sinks = list(sinks)
        self._values: dict[str, list[float]] = {}
        self._closed = False

    def record(self, key: str, value: MetricValue) -> None:
        """Add one value for `key` to the current step; NaN is kept and propagates."""
        self._values.setdefault(key, []).append(_as_float(key, value))

    def record_all(self, key: str, values: Iterable[float]) -> None:
        """Record values the trainer already validated (rewards) under `key`, unchecked."""
        self._values.setdefault(key, []).extend(values)

    def record_many(self, metrics: Mapping[str, MetricValue]) -> None:
        """`record` each item; all values are checked before any is recorded."""
        checked = [(key, _as_float(key, value)) for key, value in metrics.items()]
        for key, value in checked:
            self._values.setdefault(key, []).append(value)

    def flush(self) -> dict[str, float]:
        """Reduce every key recorded since the last flush (keys sorted), then start afresh."""
        values, self._values = self._values, {}
        return {key: _reduction(key)(values[key]) for key in sorted(values)}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write `metrics` to every sink; a failing sink does not starve the others of the step."""
        if self._closed:
            raise RuntimeError(f"MetricsAggregator.log(step={step}) called after close()")
        first_error: BaseException | None = None
        for sink in self._sinks:
            try:
                sink.write(step, metrics)
            except Exception as e:
                if first_error is None:
                    first_error = e
        if first_error is not None:
            raise first_error

    def close(self) -> None:
        """Close every sink once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        _close_all(self._sinks)


def _compact(value: float) -> str:
    """A number in at most ~5 characters: 0.412, 12.5, 1.2k, 3.4M."""
    if not math.isfinite(value):
        return str(value)
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    """`m:ss` below an hour, `h:mm:ss` above."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ConsoleSink:
    """A live progress line: step, reward, staleness and token lag, the share of tokens thrown
    away (when any), throughput, eval accuracy, elapsed and ETA.

    On a terminal the line is rewritten in place with a carriage return; elsewhere (CI logs, files)
    a step gets its own line at most every `interval_s` seconds, and always with an evaluation and
    at the last step. Metrics missing from a step are left out of its line. The ETA is paced on
    the steps after the first, which carries one-time costs (compilation, warm-up).
    """

    def __init__(
        self, total_steps: int, stream: TextIO | None = None, *, interval_s: float = 10.0
    ) -> None:
        self._total_steps = total_steps
        self._stream = stream if stream is not None else sys.stderr
        self._is_tty = self._stream.isatty()
        self._interval_s = interval_s
        self._start_s = time.monotonic()
        self._printed_s = -math.inf
        self._held = ""  # off a terminal: the newest line not printed yet, printed at close
        self._first: tuple[int, float] | None = None  # the first trained step, and when it ended
        self._last_width = 0
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._first is None and "time/step" in metrics:
            # A resumed run starts mid-way, and step 0 is an evaluation: pace the ETA on the
            # steps this process has trained.
            self._first = (step, time.monotonic())
        line = self._format(step, metrics)
        now = time.monotonic()
        due = now - self._printed_s >= self._interval_s
        if not (self._is_tty or due or "eval/accuracy" in metrics or step >= self._total_steps):
            self._held = line
            return
        self._printed_s, self._held = now, ""
        if self._is_tty:
            padding = " " * max(0, self._last_width - len(line))
            self._stream.write(f"\r{line}{padding}")
            self._last_width = len(line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._held:  # a run that stopped early: its last step still gets its line
            self._stream.write(self._held + "\n")
            self._stream.flush()
        if self._is_tty and self._last_width:
            self._stream.write("\n")
            self._stream.flush()

    def _format(self, step: int, metrics: Mapping[str, float]) -> str:
        parts = [f"step {step}/{self._total_steps}"]
        if "reward/mean" in metrics:
            parts.append(f"reward {_compact(metrics['reward/mean'])}")
        staleness = [
            _compact(metrics[key]) for key in ("staleness/mean", "staleness/max") if key in metrics
        ]
        if staleness:
            parts.append(f"stale {'/'.join(staleness)}")
        lag = [
            _compact(metrics[key]) for key in ("lag/token_mean", "lag/token_max") if key in metrics
        ]
        if lag:
            parts.append(f"token lag {'/'.join(lag)}")
        generated, discarded = metrics.get("tokens/generated"), metrics.get("tokens/discarded")
        if generated and discarded:
            parts.append(f"discarded {discarded / generated:.0%} of tokens")
        if "throughput/tokens_per_s" in metrics:
            parts.append(f"{_compact(metrics['throughput/tokens_per_s'])} tok/s")
        if "eval/accuracy" in metrics:
            parts.append(f"eval {_compact(metrics['eval/accuracy'])}")
        parts.append(self._timing(step))
        return " | ".join(parts)

    def _timing(self, step: int) -> str:
        now = time.monotonic()
        elapsed_s = now - self._start_s
        if self._first is None:
            return f"{_duration(elapsed_s)} elapsed"
        first_step, first_s = self._first
        steps_done, paced_s = step - first_step, now - first_s
        remaining = self._total_steps - step
        if steps_done <= 0 or remaining <= 0 or paced_s <= 0:
            return f"{_duration(elapsed_s)} elapsed"
        eta_s = remaining * paced_s / steps_done
        return f"{_duration(elapsed_s)} elapsed, ETA {_duration(eta_s)}"


def _json_value(value: float) -> float | int | None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    number = float(value)
    return number if math.isfinite(number) else None


class JsonlSink:
    """`metrics.jsonl`: one JSON object per step, `{"step": step, **metrics}`, NaN/inf as null.

    The file is opened for append, so a resumed run continues the same file, and each line is
    flushed as it is written, so a crash keeps every step logged before it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {key: _json_value(value) for key, value in metrics.items() if key != "step"}
        record = {"step": step, **values}  # the step as the integer it is, whatever `metrics` say
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard event files under `log_dir`: one scalar per metric name, flushed every step.

    `purge_step` (on resume: the first step redone) hides the events a killed run wrote from that
    step on, so a resumed run's curves show each step once, like `metrics.jsonl`.
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                f"logging.tensorboard=true needs the tensorboard package ({e}); "
                "pip install tensorboard or set logging.tensorboard=false"
            ) from e
        self.log_dir = log_dir
        self._writer: SummaryWriter = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run: online when WANDB_API_KEY is set, offline (under `run_dir`) if not.

    Each sink owns its own run, so two sinks in one process (tests, sweeps) do not share one.
    """

    def __init__(self, project: str, name: str, run_dir: Path, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(
                f"logging.wandb=true needs the wandb package ({e}); "
                "pip install 'unified[wandb]' or set logging.wandb=false"
            ) from e
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run: Run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            config=dict(config),
            mode="online" if os.environ.get("WANDB_API_KEY") else "offline",
            reinit="create_new",
        )
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._run.finish()


def build_sinks(
    logging: LoggingConfig,
    run_path: Path,
    *,
    total_steps: int,
    run_name: str,
    config: Mapping[str, Any],
    resumed_step: int | None = None,
) -> list[MetricsSink]:
    """The sinks `logging:` asks for; if one cannot be built, those already built are closed."""
    factories: list[Callable[[], MetricsSink]] = []
    purge = None if resumed_step is None else max(0, resumed_step + 1)
    if logging.console:
        factories.append(lambda: ConsoleSink(total_steps))
    if logging.jsonl:
        factories.append(lambda: JsonlSink(run_path / "metrics.jsonl"))
    if logging.tensorboard:
        factories.append(lambda: TensorBoardSink(run_path / "tensorboard", purge))
    if logging.wandb:
        factories.append(lambda: WandbSink(logging.wandb_project, run_name, run_path, config))
    sinks: list[MetricsSink] = []
    try:
        for factory in factories:
            sinks.append(factory())
    except BaseException:
        _close_all(sinks)
        raise
    return sinks


def metrics_for(config: TrainerConfig, resumed_step: int | None = None) -> MetricsAggregator:
    """The aggregator with every sink `config.logging` asks for, in `config.run_path`.

    `resumed_step`: the checkpoint step a resumed run continues from (sinks that can rewind do).

    Blocking (W&B starts its run here): call it through `asyncio.to_thread` on an event loop.
    """
    sinks = build_sinks(
        config.logging,
        config.run_path,
        total_steps=config.trainer.total_steps,
        run_name=config.name,
        config=config.public_dump(),
        resumed_step=resumed_step,
    )
    return MetricsAggregator(sinks)
