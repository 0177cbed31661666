"""Tests of `unified.metrics`: reduction rules, and what each sink leaves behind."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from unified.config import LoggingConfig
from unified.metrics import (
    METRIC_NAMES,
    ConsoleSink,
    JsonlSink,
    MetricsAggregator,
    TensorBoardSink,
    WandbSink,
    build_sinks,
)


class _RecordingSink:
    """A sink that remembers what it was given and how often it was closed."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, dict[str, float]]] = []
        self.close_calls = 0

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.writes.append((step, dict(metrics)))

    def close(self) -> None:
        self.close_calls += 1


class _FailingSink(_RecordingSink):
    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        super().close()
        raise OSError("close failed")


class _TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def _contract_metrics(step: int) -> dict[str, float]:
    return {name: float(step) for name in METRIC_NAMES if name != "step"}


def test_flush_sums_groups_and_episodes_counts() -> None:
    aggregator = MetricsAggregator()
    for value in (1, 2, 3):
        aggregator.record("groups/trained", value)
        aggregator.record("episodes/errors", value)
        aggregator.record("rollout/tokens", value)
        aggregator.record("eval/count", value)

    flushed = aggregator.flush()

    for key in ("groups/trained", "episodes/errors", "rollout/tokens", "eval/count"):
        assert flushed[key] == 6.0, f"{key} counts must add up over the step, got {flushed[key]}"


def test_flush_takes_max_and_min_by_suffix() -> None:
    aggregator = MetricsAggregator()
    aggregator.record_many({"staleness/max": 1, "reward/min": 0.5})
    aggregator.record_many({"staleness/max": 3, "reward/min": -0.5})
    aggregator.record_many({"staleness/max": 2, "reward/min": 0.0})

    flushed = aggregator.flush()

    assert flushed["staleness/max"] == 3.0, f"/max keys keep the largest value, got {flushed}"
    assert flushed["reward/min"] == -0.5, f"/min keys keep the smallest value, got {flushed}"


def test_flush_averages_by_default_and_keeps_last_step_and_version() -> None:
    aggregator = MetricsAggregator()
    for step, version, reward in ((1, 0, 0.0), (2, 1, 0.5), (3, 1, 1.0)):
        aggregator.record_many(
            {"step": step, "policy/version": version, "progress/fraction": step / 3}
        )
        aggregator.record("reward/mean", reward)

    flushed = aggregator.flush()

    assert flushed["reward/mean"] == pytest.approx(0.5), f"default is the mean, got {flushed}"
    assert flushed["step"] == 3.0, f"step keeps its last value, got {flushed}"
    assert flushed["policy/version"] == 1.0, f"policy/version keeps its last value, got {flushed}"
    assert flushed["progress/fraction"] == 1.0, f"progress/ keeps its last value, got {flushed}"


def test_flush_returns_sorted_keys_and_clears_the_step() -> None:
    aggregator = MetricsAggregator()
    aggregator.record("train/loss", 1.0)
    aggregator.record("reward/mean", 0.2)

    first = aggregator.flush()
    second = aggregator.flush()

    assert list(first) == ["reward/mean", "train/loss"], f"keys must be sorted, got {list(first)}"
    assert second == {}, f"flush must clear what was recorded, second flush gave {second}"


def test_record_accepts_numpy_scalars_and_keeps_nan() -> None:
    aggregator = MetricsAggregator()
    aggregator.record("train/loss", np.float32(2.0))
    aggregator.record("groups/trained", np.int64(4))
    aggregator.record("episodes/timeouts", np.bool_(True))
    aggregator.record("train/entropy", math.nan)

    flushed = aggregator.flush()

    assert flushed["train/loss"] == 2.0, f"numpy float must be accepted, got {flushed}"
    assert flushed["groups/trained"] == 4.0, f"numpy int must be accepted, got {flushed}"
    assert flushed["episodes/timeouts"] == 1.0, f"numpy bool must be accepted, got {flushed}"
    assert math.isnan(flushed["train/entropy"]), f"NaN must survive the reduction, got {flushed}"


def test_record_rejects_a_non_number_naming_the_key_and_type() -> None:
    aggregator = MetricsAggregator()

    with pytest.raises(TypeError, match=r"'reward/mean'.*str") as excinfo:
        aggregator.record("reward/mean", "0.5")  # type: ignore[arg-type]

    assert "reward/mean" in str(excinfo.value), f"message must name the key: {excinfo.value}"


def test_log_writes_every_sink_even_when_one_fails() -> None:
    first, failing, last = _RecordingSink(), _FailingSink(), _RecordingSink()
    aggregator = MetricsAggregator([first, failing, last])

    with pytest.raises(OSError, match="disk full"):
        aggregator.log(7, {"reward/mean": 0.5})

    assert first.writes == [(7, {"reward/mean": 0.5})], f"first sink got {first.writes}"
    assert last.writes == [(7, {"reward/mean": 0.5})], f"sink after the failure got {last.writes}"


def test_close_closes_every_sink_once_even_when_one_raises() -> None:
    first, failing, last = _RecordingSink(), _FailingSink(), _RecordingSink()
    aggregator = MetricsAggregator([first, failing, last])

    with pytest.raises(OSError, match="close failed"):
        aggregator.close()
    aggregator.close()

    closes = [first.close_calls, failing.close_calls, last.close_calls]
    assert closes == [1, 1, 1], f"each sink must be closed exactly once, got {closes}"


def test_opposite_infinities_and_overflowing_sums_aggregate_instead_of_raising() -> None:
    """A loss of +inf in one micro-batch and -inf in the next must reach the trainer's bad-step
    guard, not crash the metrics with fsum's ValueError."""
    aggregator = MetricsAggregator([])
    aggregator.record_all("train/loss", [math.inf, -math.inf])
    aggregator.record_all("groups/tokens", [1e308, 1e308])
    aggregator.record_all("reward/std", [math.inf, 1.0])
    aggregator.record_all("train/spread/std", [1e200, -1e200])
    metrics = aggregator.flush()
    assert math.isnan(metrics["train/loss"]) and metrics["groups/tokens"] == math.inf
    assert math.isnan(metrics["reward/std"]) and metrics["train/spread/std"] == math.inf


def test_jsonl_sink_writes_one_object_per_step_with_null_for_nan(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)

    for step in (1, 2):
        metrics = _contract_metrics(step)
        metrics["train/kl_sample_train"] = math.nan
        metrics["throughput/tokens_per_s"] = math.inf
        sink.write(step, metrics)
    sink.close()

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2], f"one line per step expected, got {records}"
    assert set(records[0]) == set(METRIC_NAMES), f"keys must be the contract: {sorted(records[0])}"
    assert records[1]["reward/mean"] == 2.0, f"values must round-trip, got {records[1]}"
    assert records[0]["train/kl_sample_train"] is None, f"NaN must be null, got {records[0]}"
    assert records[0]["throughput/tokens_per_s"] is None, f"inf must be null, got {records[0]}"


def test_jsonl_sink_keeps_written_lines_before_close(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)

    sink.write(1, {"reward/mean": 0.25})
    on_disk = path.read_text()
    sink.close()

    assert json.loads(on_disk) == {"step": 1, "reward/mean": 0.25}, f"unflushed line: {on_disk!r}"


def test_console_sink_prints_one_line_per_step_when_not_a_tty() -> None:
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=10, stream=stream, interval_s=0.0)

    sink.write(1, {"reward/mean": 0.4123, "throughput/tokens_per_s": 1234.0, "time/step": 1.0})
    sink.write(2, {"reward/mean": 0.5, "staleness/mean": 0.5, "staleness/max": 1.0})
    sink.close()

    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, f"one line per step expected, got {lines}"
    assert "\r" not in stream.getvalue(), f"no carriage returns off a tty: {stream.getvalue()!r}"
    assert "step 1/10" in lines[0] and "0.412" in lines[0], f"step and reward missing: {lines[0]}"
    assert "1.2k tok/s" in lines[0], f"throughput must be compact: {lines[0]}"
    assert "step 2/10" in lines[1] and "0.5" in lines[1], f"step and reward missing: {lines[1]}"
    assert "ETA" in lines[1], f"an ETA is expected mid-run: {lines[1]}"


def test_console_sink_off_a_tty_prints_every_interval_evaluations_and_the_last_step() -> None:
    # A 900-step run in a CI log: not 900 lines.
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=50, stream=stream, interval_s=3600.0)
    for step in range(1, 51):
        sink.write(step, {"reward/mean": 0.5, **({"eval/accuracy": 0.2} if step == 25 else {})})
    sink.close()
    steps = [line.split("|")[0].strip() for line in stream.getvalue().splitlines()]
    assert steps == ["step 1/50", "step 25/50", "step 50/50"]


def test_console_sink_off_a_tty_prints_the_last_step_of_a_run_that_stopped_early() -> None:
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=50, stream=stream, interval_s=3600.0)
    for step in range(1, 8):  # stopped at step 7 (max_time_s, a signal)
        sink.write(step, {"reward/mean": 0.5, "time/step": 1.0})
    sink.close()
    steps = [line.split("|")[0].strip() for line in stream.getvalue().splitlines()]
    assert steps == ["step 1/50", "step 7/50"]


def test_console_sink_paces_the_eta_on_trained_steps_not_the_step_0_evaluation() -> None:
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=10, stream=stream, interval_s=0.0)
    sink.write(0, {"eval/accuracy": 0.1})
    sink.write(1, {"reward/mean": 0.5, "time/step": 1.0})
    lines = stream.getvalue().splitlines()
    assert "ETA" not in lines[0] and "ETA" not in lines[1], "no pace before two trained steps"
    sink.write(2, {"reward/mean": 0.5, "time/step": 1.0})
    assert "ETA" in stream.getvalue().splitlines()[2]


def test_console_sink_rewrites_one_line_with_carriage_return_on_a_tty() -> None:
    stream = _TtyStream()
    sink = ConsoleSink(total_steps=3, stream=stream)

    sink.write(1, {"reward/mean": 0.125, "eval/accuracy": 0.75, "throughput/tokens_per_s": 9.0})
    sink.write(2, {"reward/mean": 0.25})
    sink.close()

    output = stream.getvalue()
    assert output.count("\r") == 2, f"each step must start with \\r, got {output!r}"
    assert output.endswith("\n") and output.count("\n") == 1, f"newline only on close: {output!r}"
    first, second = output.rstrip("\n").split("\r")[1:]
    assert "eval 0.75" in first, f"eval accuracy shown when present: {first!r}"
    assert len(second) >= len(first), f"the shorter line must be padded to clear: {output!r}"


def test_tensorboard_sink_writes_scalars_readable_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tensorboard"
    sink = TensorBoardSink(log_dir)
    sink.write(1, {"reward/mean": 0.25, "train/loss": 1.5})
    sink.write(2, {"reward/mean": 0.75, "train/loss": 1.0})
    sink.close()

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    rewards = [(e.step, e.value) for e in accumulator.Scalars("reward/mean")]
    losses = [(e.step, e.value) for e in accumulator.Scalars("train/loss")]
    assert rewards == [(1, 0.25), (2, 0.75)], f"reward/mean read back as {rewards}"
    assert losses == [(1, 1.5), (2, 1.0)], f"train/loss read back as {losses}"


def test_tensorboard_sink_of_a_resumed_run_hides_the_steps_it_redoes(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tensorboard"
    killed = TensorBoardSink(log_dir)
    for step in (1, 2, 3):  # a run killed after step 3, its checkpoint at step 2
        killed.write(step, {"reward/mean": float(step)})
    killed.close()
    resumed = TensorBoardSink(log_dir, purge_step=3)
    resumed.write(3, {"reward/mean": 30.0})
    resumed.write(4, {"reward/mean": 40.0})
    resumed.close()

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    rewards = [(e.step, e.value) for e in accumulator.Scalars("reward/mean")]
    assert rewards == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)], f"read back as {rewards}"


def test_wandb_sink_without_api_key_creates_an_offline_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    run_dir = tmp_path / "run"

    sink = WandbSink("unified-test", "offline-run", run_dir, {"trainer": {"lr": 1e-4}})
    sink.write(1, {"reward/mean": 0.5})
    sink.close()
    sink.close()

    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, f"one offline run expected under {run_dir}, got {offline_runs}"
    assert list(offline_runs[0].glob("*.wandb")), f"no run data in {offline_runs[0]}"


def test_build_sinks_builds_what_logging_asks_for(tmp_path: Path) -> None:
    logging = LoggingConfig(console=True, jsonl=True, tensorboard=False, wandb=False)

    sinks = build_sinks(logging, tmp_path, total_steps=5, run_name="r", config={})
    MetricsAggregator(sinks).close()

    kinds = [type(sink) for sink in sinks]
    assert kinds == [ConsoleSink, JsonlSink], f"console and jsonl expected, got {kinds}"
    assert (tmp_path / "metrics.jsonl").exists(), "JsonlSink must write run_path/metrics.jsonl"


def test_token_lag_is_over_every_trained_token_and_length_over_usable_episodes() -> None:
    from unified.config import load_config
    from unified.groups import GroupTicket
    from unified.recorder import StepRecorder
    from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup

    def episode(n: int, versions: list[int] | None, version: int = 3) -> Episode:
        out = ModelOutput(
            text="x" * n,
            prompt_ids=[1],
            completion_ids=[7] * n,
            logprobs=[-0.5] * n,
            finish_reason="stop",
            policy_version=version,
            token_versions=versions,
        )
        return Episode(task_id="t", rollout_index=0, trajectories=[Trajectory(
            steps=[Step(output=out)], reward=0.0
        )])  # fmt: skip

    config = load_config({"workflow": "unified.testing:BanditWorkflow"})
    recorder = StepRecorder(config, MetricsAggregator())
    try:
        # 100 tokens: 99 sampled at version 5 and one at version 0, trained at version 5.
        spanning = episode(50, [0] + [5] * 49)
        whole = episode(50, None, version=5)
        for e in (spanning, whole, episode(200, None)):  # a long one generated, not trained
            recorder.episode(e, None, e.completion_tokens)
        group = TrajectoryGroup(task_id="t", episodes=[spanning, whole], advantages=[1.0, -1.0],
                                policy_version=0)  # fmt: skip
        line = recorder._token_accounting([(GroupTicket(0, 0, "g", "t"), group)], trained_at=5)
    finally:
        recorder._writer.close()
    assert line["tokens/generated"] == 300 and line["tokens/trained"] == 100
    assert line["lag/token_mean"] == pytest.approx(5 / 100)
    assert (line["lag/token_p99"], line["lag/token_max"]) == (0.0, 5.0), "one token in 100"
    assert line["length/trained_over_generated"] == pytest.approx(50 / 100), "the long one left"
