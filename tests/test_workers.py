"""Rollout workers on Ray: countdown episodes run in two actors, and a worker's death loses none.

One private Ray on 127.0.0.1 serves the module (start-up is the slow part, from 15 s to over a
minute on a loaded 2-core machine); each run starts its two workers in it and kills them at the
end (about 10-20 s a run once Ray is up). The policy is the local backend's built-in model,
served to the workers by the trainer process.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.local.backend import LocalBackend
from examples.countdown.workflow import CountdownWorkflow
from tests.conftest import ConfigFactory
from unified import UnifiedTrainer
from unified.errors import BackendError
from unified.protocol import RolloutEngine, TokenSampler
from unified.types import ModelOutput, SamplingParams, Task, Trajectory, TrajectoryGroup

ray = pytest.importorskip("ray")

STEPS, BATCH, GROUP = 2, 2, 4


@pytest.fixture(scope="module")
def private_ray() -> Iterator[None]:
    from unified.ray_runtime import start_local_ray

    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


class PidCountdown(CountdownWorkflow):
    """Countdown that records the process each episode ran in (`info["pid"]` of its steps)."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        trajectory = await super().run(task, model)
        for step in trajectory.steps:
            step.info["pid"] = os.getpid()
        return trajectory


class SlowCountdown(PidCountdown):
    """Countdown whose episodes each take 1 s before the model call."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        await asyncio.sleep(1.0)
        return await super().run(task, model)


class SlowToArrive(PidCountdown):
    """Takes 10 s to unpickle in its worker, as a workflow importing heavy modules on a loaded
    machine does: longer than the 8 s stall deadline its test sets."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_arrive_slowly, ())


def _arrive_slowly() -> SlowToArrive:
    time.sleep(10)
    return SlowToArrive()


class DiesOnce(PidCountdown):
    """Kills its own worker process in the middle of the first episode of task `doomed_task`.

    An instance travels to the workers pickled, with `marker`; the marker file makes it once.
    """

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        trajectory = await super().run(task, model)
        if not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)
        return trajectory


class UnpicklableOnce(PidCountdown):
    """The first episode's result holds a lock, which no pickle carries back from its worker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        trajectory = await super().run(task, model)
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))  # once, across the workers
        except FileExistsError:
            return trajectory
        trajectory.steps[0].info["lock"] = threading.Lock()
        return trajectory


class RecordingBackend(LocalBackend):
    """The local backend, keeping every group it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[TrajectoryGroup] = []

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self.trained.extend(groups)
        return await super().forward_backward(groups)


def countdown_on_two_workers(make_config: ConfigFactory) -> dict[str, Any]:
    return make_config(
        mode="async",
        backend="local",
        workflow="tests.test_workers:PidCountdown",
        model="builtin:tiny",
        data={"train": {"generator": "examples.countdown.tasks:make_tasks", "n": 32}},
        trainer={
            "total_steps": STEPS,
            "batch_size": BATCH,
            "group_size": GROUP,
            "lr": 1e-3,
            "filter_groups": False,
            "workflow_timeout_s": 120,
            "stall_timeout_s": 300,  # Ray actors start slowly on a loaded machine
        },
        sampling={"train": {"max_tokens": 6}},
        rollout={"workers": 2, "worker_cpus": 0.5},
        # The strict rule without over-admission: the trainer waits for every group it admits,
        # so each one trains (none is left requeued at the end) and a held call holds its step.
        async_={"strict_staleness": True, "over_admit": 0.0},
    )


def trained_pids(backend: RecordingBackend) -> set[int]:
    return {
        step.info["pid"]
        for group in backend.trained
        for episode in group.episodes
        for trajectory in episode.trajectories
        for step in trajectory.steps
    }


async def test_a_workers_model_calls_wait_for_the_trainers_replies_in_one_batch() -> None:
    from unified.workers import _TrainerSampler

    engine = _TrainerSampler(tokenizer=None)
    first = asyncio.create_task(engine.sample([1], SamplingParams(seed=1)))
    second = asyncio.create_task(engine.sample([1, 2], SamplingParams(seed=2)))
    requests, given_up = await engine.take(wait_s=5.0)
    assert given_up == []
    assert [(ids, params.seed) for _, ids, params in requests] == [
        ([1], 1),
        ([1, 2], 2),
    ], "both calls are taken in one long poll"
    output = ModelOutput(
        text="x",
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[-1.0],
        finish_reason="stop",
        policy_version=0,
    )
    engine.deliver([(requests[0][0], output), (requests[1][0], BackendError("no sampler"))])
    assert await first == output
    with pytest.raises(BackendError, match="no sampler"):
        await second
    assert await engine.take(wait_s=0.01) == ([], []), "nothing is left queued"


async def test_a_call_whose_workflow_gave_up_is_unsent_or_given_up_to_the_trainer() -> None:
    from unified.workers import _TrainerSampler

    engine = _TrainerSampler(tokenizer=None)
    unsent = asyncio.create_task(engine.sample([1], SamplingParams(seed=1)))
    await asyncio.sleep(0)
    unsent.cancel()  # before any take: the trainer never sees it
    with pytest.raises(asyncio.CancelledError):
        await unsent
    sent = asyncio.create_task(engine.sample([2], SamplingParams(seed=2)))
    (request,), _ = await engine.take(wait_s=5.0)
    assert request[1] == [2], "the call given up on before it was taken is not sent"
    sent.cancel()  # taken: the trainer is running it
    with pytest.raises(asyncio.CancelledError):
        await sent
    assert await engine.take(wait_s=5.0) == ([], [request[0]]), "the next poll names it"


class StuckFirstCall(LocalBackend):
    """The local backend, whose sampler holds the first model call until it is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.steps = 0
        self.cancelled_at_step: list[int] = []

    async def optim_step(self) -> dict[str, float]:
        self.steps += 1
        return await super().optim_step()

    def token_sampler(self) -> TokenSampler:
        return HoldFirstCall(super().token_sampler(), self)


class HoldFirstCall:
    """A sampler that holds the backend's first call until it is cancelled."""

    def __init__(self, inner: TokenSampler, backend: StuckFirstCall) -> None:
        self.inner, self.backend = inner, backend

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        if self.backend.held:
            return await self.inner.sample(prompt_ids, params)
        self.backend.held += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.backend.cancelled_at_step.append(self.backend.steps)
        raise AssertionError("never set")


@pytest.mark.usefixtures("private_ray")
def test_a_model_call_whose_workflow_timed_out_in_a_worker_stops_in_the_trainer(
    make_config: ConfigFactory,
) -> None:
    """The workflow's timeout ends its episode in the worker; the trainer must stop sampling
    for it too, or the request runs to `max_tokens` while holding the sampler."""
    config = countdown_on_two_workers(make_config)
    config["trainer"] |= {"workflow_timeout_s": 2}
    backend = StuckFirstCall()
    result = UnifiedTrainer(config, backend=backend).fit()
    assert result.steps == STEPS and backend.held == 1
    # Not only when the run ends and its serving stops: the episode's timeout ends step 1.
    (step,) = backend.cancelled_at_step
    assert step < STEPS, "the held call ran until the run ended"


@pytest.mark.usefixtures("private_ray")
def test_countdown_episodes_run_in_two_ray_workers(make_config: ConfigFactory) -> None:
    backend = RecordingBackend()
    result = UnifiedTrainer(countdown_on_two_workers(make_config), backend=backend).fit()

    assert result.steps == STEPS
    assert len(backend.trained) == STEPS * BATCH, "every admitted group is trained"
    episodes = [e for group in backend.trained for e in group.episodes]
    assert all(e.status == "ok" for e in episodes), [e.error for e in episodes]
    pids = trained_pids(backend)
    assert os.getpid() not in pids, "no episode ran in the trainer process"
    assert len(pids) == 2, f"episodes ran in {len(pids)} processes, expected the two workers"


@pytest.mark.usefixtures("private_ray")
def test_killing_a_worker_mid_run_loses_no_episode(
    make_config: ConfigFactory, tmp_path: Path
) -> None:
    marker = tmp_path / "killed"
    backend = RecordingBackend()
    config = countdown_on_two_workers(make_config)
    trainer = UnifiedTrainer(config, workflow=DiesOnce(marker), backend=backend)

    result = trainer.fit()

    assert marker.exists(), "a worker was killed mid-run"
    assert result.steps == STEPS
    assert result.metrics["episodes/errors"] == 0.0
    ledger = [json.loads(line) for line in (result.run_dir / "ledger.jsonl").open()]
    assert [entry["outcome"] for entry in ledger] == ["trained"] * (STEPS * BATCH)
    for group in backend.trained:
        indices = sorted(e.rollout_index for e in group.episodes)
        assert indices == list(range(GROUP)), f"group {group.task_id} has rollouts {indices}"
        assert all(e.status == "ok" for e in group.episodes)


@pytest.mark.usefixtures("private_ray")
def test_episodes_past_a_workers_slots_wait_in_the_trainer_and_lose_no_worker(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """One worker with one slot and 8 episodes a step: queued inside the worker, the later ones
    passed their deadline (workflow_timeout_s + stall_timeout_s, 9.5 s) while waiting, and the
    healthy worker was killed as lost."""
    config = countdown_on_two_workers(make_config)
    config["trainer"] |= {"total_steps": 2, "workflow_timeout_s": 1.5, "stall_timeout_s": 8}
    config["rollout"] = {"workers": 1, "worker_cpus": 0.5, "worker_concurrency": 1}
    config["async"] = {"max_concurrency": 16}
    result = UnifiedTrainer(config, workflow=SlowCountdown(), backend=LocalBackend()).fit()
    assert result.steps == 2 and result.metrics["episodes/timeouts"] == 0.0
    assert not [r for r in caplog.records if "lost" in r.getMessage()], "a worker was lost"


@pytest.mark.usefixtures("private_ray")
def test_a_worker_slower_to_start_than_the_stall_deadline_still_starts(
    make_config: ConfigFactory,
) -> None:
    config = countdown_on_two_workers(make_config)
    config["trainer"] |= {"total_steps": 1, "workflow_timeout_s": 1.5, "stall_timeout_s": 8}
    config["rollout"] = {"workers": 1, "worker_cpus": 0.5}
    result = UnifiedTrainer(config, workflow=SlowToArrive(), backend=LocalBackend()).fit()
    assert result.steps == 1 and result.metrics["episodes/errors"] == 0.0


@pytest.mark.usefixtures("private_ray")
def test_an_episode_whose_result_cannot_come_back_is_an_error_not_the_end(
    make_config: ConfigFactory, tmp_path: Path
) -> None:
    marker = tmp_path / "sent"
    config = countdown_on_two_workers(make_config)
    trainer = UnifiedTrainer(config, workflow=UnpicklableOnce(marker), backend=LocalBackend())

    result = trainer.fit()

    assert marker.exists() and result.steps == STEPS
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    assert sum(line["episodes/errors"] for line in lines) == 1.0


@pytest.mark.usefixtures("private_ray")
def test_a_trainer_process_joins_an_existing_cluster_through_ray_address(
    make_config: ConfigFactory, tmp_path: Path
) -> None:
    import subprocess
    import sys

    import yaml

    # The module's Ray stands in for a cluster started elsewhere (`ray start --head`): another
    # process joins it by address, runs its workers there and leaves it running.
    address = ray.get_runtime_context().gcs_address
    config = countdown_on_two_workers(make_config)
    config["rollout"] = {**config["rollout"], "ray_address": address}
    config_path = tmp_path / "joined.yaml"
    config_path.write_text(yaml.safe_dump(config))
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "unified.cli", "train", str(config_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    ledger_path = Path(config["logging"]["run_dir"]) / config["name"] / "ledger.jsonl"
    ledger = [json.loads(line) for line in ledger_path.open()]
    assert [entry["outcome"] for entry in ledger] == ["trained"] * (STEPS * BATCH)
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2.0, (
        "the cluster outlives the trainer that joined it"
    )


def test_a_ray_start_that_timed_out_is_tried_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray gives its raylet a fixed 30 s at start-up; a loaded machine can miss it. Nothing is
    # started here: `ray.init` answers as a start that timed out, then as one that worked.
    from unified.ray_runtime import init_ray

    calls: list[dict[str, Any]] = []
    shutdowns: list[bool] = []

    def init(**settings: Any) -> None:
        calls.append(settings)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    init_ray(num_cpus=2, address=None)
    assert calls == [{"num_cpus": 2, "address": None}] * 2
    assert shutdowns == [True], "the half-started node is shut down before the second try"


def test_a_ray_start_that_failed_otherwise_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from unified.ray_runtime import init_ray

    def init(**settings: Any) -> None:
        raise ConnectionError("could not connect to 10.0.0.9:6379")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ConnectionError, match="could not connect"):
        init_ray(address="10.0.0.9:6379")
