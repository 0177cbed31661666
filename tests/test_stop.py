"""Orderly stop: SIGINT/SIGTERM during `fit` stop dispatch, finish or abandon the step in
progress, checkpoint, flush metrics and raise; the CLI exits 130/143; a second signal exits at
once; `resume=true` then trains what an uninterrupted run trains."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.crashing import check_run
from tests.conftest import ConfigFactory
from tests.stopping import InterruptingWorkflow
from unified import UnifiedTrainer
from unified.checkpoint import RunDirectory
from unified.protocol import BackendCapabilities, RunStatus
from unified.testing import BanditBackend, bandit_tasks
from unified.trainer import TrainingInterrupted

REPO = Path(__file__).resolve().parent.parent
EPISODES_PER_STEP = 2 * 4  # batch_size x group_size of `make_config`


class ToldBackend(BanditBackend):
    """The bandit, keeping what the trainer told it of how the run ended."""

    outcome: tuple[str, str | None] | None = None

    def set_outcome(self, status: RunStatus, detail: str | None = None) -> None:
        self.outcome = (status, detail)


def fit(config: dict[str, Any], workflow: Any = None, backend: Any = None) -> Any:
    trainer = UnifiedTrainer(config, workflow=workflow, backend=backend or BanditBackend())
    return trainer.fit()


def trained(run_dir: Path) -> list[tuple[str, int]]:
    return [
        (e.group_id, e.step) for e in RunDirectory(run_dir).read_ledger() if e.outcome == "trained"
    ]


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def run_config(make_config: ConfigFactory, name: str, **trainer: Any) -> dict[str, Any]:
    # No filtering: every group trains, so episode `k * EPISODES_PER_STEP` starts step k + 1.
    settings = {"total_steps": 5, "filter_groups": False, **trainer}
    return make_config(name=name, trainer=settings, data={"train": _BANDIT_DATA})


_BANDIT_DATA = {"generator": "unified.testing:bandit_tasks", "n": 24}


@pytest.mark.parametrize(
    ("signal_number", "exit_code", "episode"),
    [
        # The first episode of step 3 starts as step 2 ends; the signal may come between steps.
        (signal.SIGINT, 130, 2 * EPISODES_PER_STEP),
        (signal.SIGTERM, 143, 3 * EPISODES_PER_STEP - 1),  # its last one
    ],
)
def test_a_signal_lets_the_step_in_progress_train_then_checkpoints_and_raises(
    make_config: ConfigFactory, signal_number: int, exit_code: int, episode: int
) -> None:
    full_backend, stopped_backend = ToldBackend(), ToldBackend()
    full = fit(run_config(make_config, "full"), backend=full_backend)
    config = run_config(make_config, "stopped")
    during_step_3 = InterruptingWorkflow(at=episode, signal_number=signal_number)
    with pytest.raises(TrainingInterrupted, match="after step 3") as info:
        fit(config, during_step_3, backend=stopped_backend)
    assert info.value.exit_code == exit_code
    assert full_backend.outcome == ("success", None), "told before its shutdown"
    assert stopped_backend.outcome is not None and stopped_backend.outcome[0] == "interrupted"
    run = RunDirectory(full.run_dir.parent / "stopped")
    assert run.latest_checkpoint() == run.checkpoints / "step_000003", "a final checkpoint"
    assert logged_steps(run.path) == [1, 2, 3], "the step in progress trained and was logged"
    resumed = fit({**config, "resume": True})
    assert resumed.steps == 5
    assert logged_steps(run.path) == [1, 2, 3, 4, 5]
    assert trained(run.path) == trained(full.run_dir), "resume trains what no stop would have"


def test_a_step_whose_groups_miss_the_grace_is_abandoned_and_trained_after_resume(
    make_config: ConfigFactory,
) -> None:
    full = fit(run_config(make_config, "full"))
    config = run_config(make_config, "stopped", stop_grace_s=0.1)
    hangs_in_step_3 = InterruptingWorkflow(
        at=2 * EPISODES_PER_STEP, signal_number=signal.SIGTERM, hang_s=60
    )
    started = time.monotonic()
    with pytest.raises(TrainingInterrupted, match="after step 2"):
        fit(config, hangs_in_step_3)
    assert time.monotonic() - started < 30, "the hanging episode was abandoned, not awaited"
    run = RunDirectory(full.run_dir.parent / "stopped")
    assert run.latest_checkpoint() == run.checkpoints / "step_000002", "save_every=0: one anyway"
    state = RunDirectory.load_state(run.checkpoints / "step_000002")
    assert len(state.redispatch) == 2, "the abandoned step's groups are dispatched again"
    assert max(e.step for e in run.read_ledger()) == 2
    fit({**config, "resume": True})
    assert logged_steps(run.path) == [1, 2, 3, 4, 5]
    assert trained(run.path) == trained(full.run_dir), "resume trains what no stop would have"


@pytest.mark.parametrize("hang_s", [0.0, 60.0])
def test_an_async_run_stopped_by_a_signal_resumes_with_every_group_ended_once(
    make_config: ConfigFactory, hang_s: float
) -> None:
    config = {
        **run_config(make_config, "async", save_every=5, stop_grace_s=0.1),
        "mode": "async",
        "async": {"max_staleness": 2, "sync_every": 1},
    }
    stops = InterruptingWorkflow(at=20, signal_number=signal.SIGTERM, hang_s=hang_s)
    with pytest.raises(TrainingInterrupted):
        fit(config, stops)
    fit({**config, "resume": True})
    check = check_run({**config, "resume": True})
    assert not check.problems, check.problems


def test_fit_restores_the_signal_handlers_it_found(make_config: ConfigFactory) -> None:
    def mine(signal_number: int, frame: Any) -> None:
        raise AssertionError("not called")

    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        fit(run_config(make_config, "plain", total_steps=1))
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# -- the command line ------------------------------------------------------------------------


def cli(config: dict[str, Any], tmp_path: Path, **env: str) -> subprocess.Popen[bytes]:
    path = tmp_path / f"{config['name']}.yaml"
    path.write_text(json.dumps(config))
    return subprocess.Popen(
        [sys.executable, "-m", "unified.cli", "train", str(path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def wait_for_stderr(process: subprocess.Popen[bytes], text: str, timeout_s: float = 60) -> str:
    """Read the child's stderr until `text` appears; fail after `timeout_s`."""
    assert process.stderr is not None
    seen = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        while text.encode() not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise AssertionError(f"no {text!r} on stderr within {timeout_s} s: {seen!r}")
            chunk = os.read(process.stderr.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"stderr closed before {text!r}: {seen!r}")
            seen += chunk
    return seen.decode()


def cli_config(make_config: ConfigFactory, **trainer: Any) -> dict[str, Any]:
    config = run_config(make_config, "cli", **trainer)
    return {**config, "backend": "unified.testing:BanditBackend"}


def test_cli_exits_143_on_sigterm_with_a_checkpoint_and_resumes_to_the_end(
    make_config: ConfigFactory, tmp_path: Path
) -> None:
    config = cli_config(make_config, stop_grace_s=0.1)
    config["workflow"] = "tests.stopping:InterruptingWorkflow"
    process = cli(
        config, tmp_path, UNIFIED_TEST_STOP_AT=str(EPISODES_PER_STEP), UNIFIED_TEST_STOP_HANG_S="60"
    )
    try:
        wait_for_stderr(process, "stop point")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143
    finally:
        process.kill()
    run = RunDirectory(Path(config["logging"]["run_dir"]) / "cli")
    assert run.latest_checkpoint() == run.checkpoints / "step_000001"
    resumed = cli({**config, "resume": True}, tmp_path)
    assert resumed.wait(timeout=120) == 0
    assert logged_steps(run.path) == [1, 2, 3, 4, 5]


def test_cli_a_second_sigint_exits_130_at_once(make_config: ConfigFactory, tmp_path: Path) -> None:
    config = cli_config(make_config, stop_grace_s=600)
    config["workflow"] = "tests.stopping:InterruptingWorkflow"
    process = cli(
        config,
        tmp_path,
        UNIFIED_TEST_STOP_AT=str(EPISODES_PER_STEP),
        UNIFIED_TEST_STOP_HANG_S="600",
    )
    try:
        wait_for_stderr(process, "stop point")
        process.send_signal(signal.SIGINT)
        wait_for_stderr(process, "stopping")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130, "the second signal does not wait for the grace"
    finally:
        process.kill()
    run = RunDirectory(Path(config["logging"]["run_dir"]) / "cli")
    assert run.latest_checkpoint() is None, "no checkpoint was written, none is half visible"


def test_a_signal_during_the_shutdown_says_the_run_is_already_over(
    make_config: ConfigFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    class SignalledAtShutdown(BanditBackend):
        async def shutdown(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.2)  # the handler runs on the event loop
            await super().shutdown()

    config = make_config(trainer={"total_steps": 2})
    result = UnifiedTrainer(
        config, backend=SignalledAtShutdown(), train_tasks=bandit_tasks(8)
    ).fit()
    assert result.steps == 2, "training was over: the run completes"
    err = capsys.readouterr().err
    assert "training is over and the run is shutting down" in err and "gets" not in err, err


def test_a_run_with_requests_across_syncs_resumes_with_every_group_ended_once(
    make_config: ConfigFactory,
) -> None:
    """The default async mode with partial rollouts: requests span syncs when the signal comes;
    the resumed run trains each group exactly once, and what an uninterrupted run trains."""
    config = {
        **run_config(make_config, "spanning", save_every=2, stop_grace_s=0.5, total_steps=6),
        "mode": "async",
        "async": {"max_staleness": 1},
    }
    partial = BackendCapabilities(partial_rollout=True)
    full = fit({**config, "name": "spanning-full"}, backend=BanditBackend(capabilities=partial))
    stops = InterruptingWorkflow(at=3 * EPISODES_PER_STEP, signal_number=signal.SIGINT)
    with pytest.raises(TrainingInterrupted):
        fit(config, stops, backend=BanditBackend(capabilities=partial))
    resumed = fit({**config, "resume": True}, backend=BanditBackend(capabilities=partial))
    assert resumed.steps == 6
    run = RunDirectory(resumed.run_dir)
    assert logged_steps(run.path) == list(range(1, 7)), "steps continue, none twice"
    check = check_run({**config, "resume": True})
    assert not check.problems, check.problems
    assert sorted(trained(run.path)) == sorted(trained(full.run_dir))
