"""Faults never hang a run: flaky workflows, stuck and failing backend calls, NaN steps.

Every fault comes from `tests/faulty.py` (seeded) or the local Tinker server's switches; each run
either completes or fails fast with a message that names the call and the pipeline's state.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ConfigFactory
from tests.faulty import NanGradient, NanThenFine, StuckInThread
from tests.test_local_backend import PROMPTS, group_of, sample, started
from unified import UnifiedTrainer
from unified.checkpoint import RunDirectory
from unified.errors import StallError, TrainingStopped, TransientBackendError
from unified.retry import RetryPolicy, retrying
from unified.testing import BanditBackend, StuckOptimStep, bandit_tasks, digits_tasks
from unified.trainer import TrainResult
from unified.types import TrajectoryGroup

NO_WAIT = {"backoff_s": 0.0}


def fit(config: dict[str, Any], backend: BanditBackend | None = None) -> TrainResult:
    backend = backend if backend is not None else BanditBackend()
    return UnifiedTrainer(config, backend=backend, train_tasks=bandit_tasks(32)).fit()


def metric_rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- the retry helper -----------------------------------------------------------------------------


async def test_a_transient_error_is_retried_until_the_call_succeeds() -> None:
    failures = [TransientBackendError("HTTP 503"), TransientBackendError("HTTP 429")]
    calls = 0

    async def call() -> str:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return "ok"

    assert await retrying("sample", call, RetryPolicy(attempts=3, **NO_WAIT)) == "ok"
    assert calls == 3, "two transient failures, then the third attempt succeeds"


async def test_the_last_transient_error_names_the_call_and_the_attempts() -> None:
    async def call() -> None:
        raise TransientBackendError("HTTP 503")

    with pytest.raises(TransientBackendError, match=r"sample failed 3 times in a row; last: HTTP"):
        await retrying("sample", call, RetryPolicy(attempts=3, **NO_WAIT))


async def test_an_error_that_is_not_transient_is_never_retried() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        await retrying("sample", call, RetryPolicy(attempts=5, **NO_WAIT))
    assert calls == 1, "a non-transient error must propagate at once"


def test_backoff_doubles_is_capped_and_jitter_only_shortens_it() -> None:
    policy = RetryPolicy(backoff_s=1.0, max_backoff_s=5.0, jitter=0.5)
    assert [policy.delay_s(r, 0.0) for r in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    draws = random.Random(0)
    jittered = [policy.delay_s(2, draws.random()) for _ in range(200)]
    assert all(2.0 < d <= 4.0 for d in jittered), "jitter takes at most half of the delay"
    assert len(set(jittered)) > 100, "clients that failed together must not retry together"


# -- the trainer's backend calls ------------------------------------------------------------------


class FlakySync(BanditBackend):
    """The first two weight syncs fail with a transient error."""

    failures = 2

    async def on_policy_updated(self, version: int) -> None:
        if self.failures:
            self.failures -= 1
            raise TransientBackendError("HTTP 503 from the weight store")
        await super().on_policy_updated(version)


class FlakyForward(BanditBackend):
    """`forward_backward` fails once with a transient error; counts its calls."""

    calls = 0

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self.calls += 1
        raise TransientBackendError("HTTP 503")


def test_a_weight_sync_that_fails_transiently_is_retried_and_the_run_completes(
    make_config: ConfigFactory,
) -> None:
    config = make_config(trainer={"retry": {"on_policy_updated": {"attempts": 3, **NO_WAIT}}})
    backend = FlakySync()
    result = fit(config, backend)
    assert result.steps == 4 and backend.failures == 0, "both failed syncs were retried"


def test_forward_backward_is_never_retried(make_config: ConfigFactory) -> None:
    backend = FlakyForward()
    with pytest.raises(TransientBackendError, match="HTTP 503"):
        fit(make_config(), backend)
    assert backend.calls == 1, "a repeated forward_backward would add the gradients twice"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_backend_call_that_never_returns_ends_the_run_naming_who_waited_on_whom(
    make_config: ConfigFactory, mode: str
) -> None:
    config = make_config(mode=mode, trainer={"backend_timeout_s": 0.5})
    started_at = time.monotonic()
    with pytest.raises(StallError) as caught:
        fit(config, StuckOptimStep())
    message = str(caught.value)
    assert time.monotonic() - started_at < 10, "the run failed fast, it did not hang"
    for part in ("'bandit' optim_step", "0.5 s", "version=0", "generating=", "ready=", "step=0"):
        assert part in message, f"{part!r} missing from: {message}"
    assert "trainer.backend_timeout_s" in message, "the message names the knob to change"


def test_fit_returns_at_the_deadline_while_a_blocking_call_stays_stuck_in_its_thread(
    make_config: ConfigFactory,
) -> None:
    """`asyncio.run` would wait for the abandoned thread when it closes the loop, and the
    interpreter's exit too: `fit` runs blocking calls on daemon threads it does not wait for."""
    started_at = time.monotonic()
    try:
        with pytest.raises(StallError, match="optim_step"):
            fit(make_config(trainer={"backend_timeout_s": 0.5}), StuckInThread())
        assert time.monotonic() - started_at < 10, "fit returned, it did not wait for the thread"
        stuck = [t for t in threading.enumerate() if t.name.startswith("unified-blocking")]
        assert stuck and all(t.daemon for t in stuck), "the exit will not wait for it either"
    finally:
        StuckInThread.release.set()


def test_a_metrics_sink_stuck_for_good_ends_the_run_at_the_stall_timeout(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint waits for the metrics of its steps: a write that never returns (a wedged
    W&B client or network filesystem) is a stall, not a hang."""
    from unified.metrics import MetricsAggregator

    release = threading.Event()
    log = MetricsAggregator.log

    def stuck_at_step_2(self: MetricsAggregator, step: int, metrics: dict[str, float]) -> None:
        if step == 2:
            release.wait(600)
        log(self, step, metrics)

    monkeypatch.setattr(MetricsAggregator, "log", stuck_at_step_2)
    trainer = {"save_every": 2, "stall_timeout_s": 1.5, "workflow_timeout_s": 1, "total_steps": 3}
    started_at = time.monotonic()
    try:
        with pytest.raises(StallError, match=r"writing the metrics of step 2 took over 1\.5 s"):
            fit(make_config(trainer=trainer))
        assert time.monotonic() - started_at < 15
    finally:
        release.set()


async def test_a_second_cancel_during_the_backends_shutdown_still_closes_the_metrics(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unified.metrics import MetricsAggregator

    closed: list[bool] = []
    close = MetricsAggregator.close

    def recording_close(self: MetricsAggregator) -> None:
        closed.append(True)
        close(self)

    monkeypatch.setattr(MetricsAggregator, "close", recording_close)
    trained, shutting_down = asyncio.Event(), asyncio.Event()

    class SlowShutdown(BanditBackend):
        async def optim_step(self) -> dict[str, float]:
            trained.set()
            return await super().optim_step()

        async def shutdown(self) -> None:
            shutting_down.set()
            await asyncio.Event().wait()

    config = make_config(trainer={"total_steps": 10_000})
    trainer = UnifiedTrainer(config, backend=SlowShutdown(), train_tasks=bandit_tasks(32))
    run = asyncio.create_task(trainer.fit_async())
    await asyncio.wait_for(trained.wait(), 30)
    run.cancel()
    await asyncio.wait_for(shutting_down.wait(), 30)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 30)
    assert closed == [True], "the sinks were closed although the shutdown was cut short"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_flaky_and_hanging_workflows_are_counted_and_the_run_completes(
    make_config: ConfigFactory, mode: str
) -> None:
    # The default async mode requeues no straggler, so every hang runs to its timeout.
    config = make_config(
        mode=mode,
        workflow="unified.testing:FlakyWorkflow",
        trainer={"total_steps": 10, "workflow_timeout_s": 0.3, "max_error_rate": 0.5},
    )
    result = fit(config)
    rows = metric_rows(result.run_dir)
    errors = sum(r["episodes/errors"] for r in rows)
    timeouts = sum(r["episodes/timeouts"] for r in rows)
    assert result.steps == 10, "10% errors and 5% hangs do not stop the run"
    assert errors > 0 and timeouts > 0, f"faults were injected: {errors=} {timeouts=}"


# -- NaN and inf steps ----------------------------------------------------------------------------


def test_a_skipped_step_is_counted_and_training_goes_on(make_config: ConfigFactory) -> None:
    result = fit(make_config(), NanThenFine())
    rows = metric_rows(result.run_dir)
    assert [r["train/skipped_steps"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    ledger = RunDirectory(result.run_dir).read_ledger()
    skipped = {e.step for e in ledger if e.reason.startswith("update skipped")}
    assert skipped == {1, 2}, "the ledger says which steps' groups were not applied"


def test_a_bad_step_the_backend_cannot_skip_is_recorded_as_applied(
    make_config: ConfigFactory,
) -> None:
    result = fit(make_config(trainer={"max_bad_steps": 5, "total_steps": 2}), NanGradient())
    ledger = RunDirectory(result.run_dir).read_ledger()
    reasons = {e.reason for e in ledger if e.outcome == "trained"}
    assert reasons == {
        "update applied (the backend cannot skip it): non-finite loss or gradient norm"
    }


def test_more_bad_steps_in_a_row_than_allowed_stop_the_run(make_config: ConfigFactory) -> None:
    config = make_config(trainer={"max_bad_steps": 2, "total_steps": 10})
    with pytest.raises(
        TrainingStopped, match=r"3 optimizer steps in a row .*trainer.max_bad_steps=2"
    ):
        fit(config, NanGradient())


async def test_the_local_backend_skips_an_update_whose_loss_is_nan() -> None:
    backend = await started()
    outputs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS)]
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    poisoned = group_of(outputs, [1.0, -1.0, 1.0, -1.0])
    poisoned.advantages[1] = math.nan  # as a broken advantage estimator would produce
    await backend.forward_backward([poisoned])
    reply = await backend.optim_step()
    after = backend.model.state_dict()
    assert reply == {"train/skipped_steps": 1.0}, reply
    assert all(torch.equal(before[k], after[k]) for k in before), "weights must not change"
    await backend.forward_backward([group_of(outputs, [1.0, -1.0, 1.0, -1.0])])
    assert "train/skipped_steps" not in await backend.optim_step(), "the next step trains"
    await backend.shutdown()


# -- the local Tinker server ----------------------------------------------------------------------


def test_a_tinker_server_that_stops_answering_fails_the_run_fast_naming_the_call(
    tmp_path: Path, make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinker_server.faults import Faults
    from tinker_server.server import LocalServer

    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    config = make_config(backend="tinker", workflow="unified.testing:DigitsWorkflow")
    config["model"] = "builtin:tiny"
    with LocalServer("builtin:tiny", store=tmp_path, faults=Faults(latency_s=10.0)) as url:
        config["tinker"] = {"base_url": url, "request_timeout_s": 1.0, "retries": 1}
        started_at = time.monotonic()
        with pytest.raises(TransientBackendError) as caught:
            UnifiedTrainer(config, train_tasks=digits_tasks()).fit()
        elapsed = time.monotonic() - started_at
    assert "create_lora_training_client failed 2 times in a row" in str(caught.value)
    assert "tinker.request_timeout_s=1 s" in str(caught.value), "the message names the deadline"
    assert elapsed < 8, f"the run took {elapsed:.0f} s to fail: it waited on the stuck call"


def test_a_second_fit_failing_before_its_run_directory_removes_nothing_of_the_first(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = UnifiedTrainer(make_config(), backend=BanditBackend(), train_tasks=bandit_tasks(32))
    first = trainer.fit()
    assert first.run_dir.is_dir()

    def fails(config: Any) -> Any:
        raise RuntimeError("the model cannot be resolved")

    monkeypatch.setattr("unified.trainer.resolve_model", fails)
    with pytest.raises(RuntimeError, match="cannot be resolved"):
        trainer.fit()
    assert (first.run_dir / "ledger.jsonl").is_file(), "the first run's directory is kept"
