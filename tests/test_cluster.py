"""Rollout workers and verl's worker group on a Ray cluster of several nodes, all on 127.0.0.1,
with nodes that die.

`ray.cluster_utils.Cluster` starts a head node (no CPUs: the trainer's driver and nothing else)
and worker nodes that each offer one `rollout` resource, so each runs one rollout worker
(`rollout.worker_resources`); the test process joins it by address as a trainer on another
machine would (`rollout.ray_address`). Nodes are small (one CPU, 150 MiB of object store) for
2 cores; each costs a few seconds to start. The cluster's health checks are fast, so a removed
node is noticed in seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from backends.verl.watch import WorkerLostError
from tests.conftest import ConfigFactory
from tests.test_verl_backend import countdown_config
from tests.test_workers import PidCountdown, RecordingBackend
from unified import UnifiedTrainer
from unified.protocol import RolloutEngine
from unified.types import Task, Trajectory

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

NODE = {"num_cpus": 1, "resources": {"rollout": 1}, "node_ip_address": "127.0.0.1"}
"""A worker node: one CPU, room for one rollout worker, on the loopback address."""


class NodeCountdown(PidCountdown):
    """Countdown that records the Ray node each episode ran on (`info["node"]`)."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        trajectory = await super().run(task, model)
        node = ray.get_runtime_context().get_node_id()
        for step in trajectory.steps:
            step.info["node"] = node
        return trajectory


class SlowNodeCountdown(NodeCountdown):
    """`NodeCountdown` whose episodes each take 0.3 s more: a run long enough for the soak."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        await asyncio.sleep(0.3)
        return await super().run(task, model)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A head and two worker nodes on 127.0.0.1; the test process joins it as the trainer."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "_system_config": {
                "health_check_initial_delay_ms": 0,
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 4,
                "worker_niceness": 0,
            },
        },
    )
    try:
        for _ in range(2):
            cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def cluster_config(make_config: ConfigFactory, address: str, **trainer: Any) -> dict[str, Any]:
    return make_config(
        mode="async",
        backend="local",
        workflow="tests.test_cluster:NodeCountdown",
        model="builtin:tiny",
        data={"train": {"generator": "examples.countdown.tasks:make_tasks", "n": 64}},
        trainer={
            "total_steps": 3,
            "batch_size": 2,
            "group_size": 4,
            "lr": 1e-3,
            "filter_groups": False,
            "workflow_timeout_s": 60,
            "stall_timeout_s": 120,
            **trainer,
        },
        sampling={"train": {"max_tokens": 6}},
        rollout={
            "workers": 2,
            "worker_cpus": 0.5,
            "worker_resources": {"rollout": 1},
            "placement": "spread",
            "ray_address": address,
            "max_worker_restarts": 50,
        },
        async_={"strict_staleness": True, "over_admit": 0.0},
    )


def nodes_of(backend: RecordingBackend) -> Counter[str]:
    return Counter(
        step.info["node"]
        for group in backend.trained
        for episode in group.episodes
        for trajectory in episode.trajectories
        for step in trajectory.steps
    )


def check_once(run_dir: Path, steps: int, batch: int) -> None:
    """Every step trained `batch` groups, no group ended twice, and each trained group has all
    its rollouts, each once."""
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").open()]
    ended = Counter(entry["group_id"] for entry in ledger)
    assert max(ended.values()) == 1, f"groups ended twice: {ended.most_common(3)}"
    trained = Counter(entry["step"] for entry in ledger if entry["outcome"] == "trained")
    assert trained == dict.fromkeys(range(1, steps + 1), batch)


def test_rollout_workers_spread_over_the_nodes_that_offer_their_resource(
    cluster: Cluster, make_config: ConfigFactory
) -> None:
    backend = RecordingBackend()
    config = cluster_config(make_config, cluster.address)
    result = UnifiedTrainer(config, backend=backend).fit()

    workers = {n.node_id for n in cluster.worker_nodes}
    used = nodes_of(backend)
    assert set(used) == workers, "one worker on each worker node, none on the head"
    check_once(result.run_dir, 3, 2)


def fit_beside(trainer: UnifiedTrainer, chaos: Callable[[Future[Any]], None]) -> Any:
    """Train on a thread while `chaos(run)` changes the cluster on this one: Ray starts a node
    only from the main thread (it installs signal handlers)."""
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(trainer.fit)
        chaos(run)
        return run.result(timeout=900)


def test_a_rollout_node_removed_mid_run_loses_no_episode_and_says_so(
    cluster: Cluster, make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    backend = RecordingBackend()
    config = cluster_config(make_config, cluster.address, total_steps=16)
    # Slow episodes keep the run going for seconds after the removal: long enough to notice it.
    config["workflow"] = "tests.test_cluster:SlowNodeCountdown"
    removed: list[str] = []
    removed_at: list[float] = []

    def remove_one_then_replace(run: Future[Any]) -> None:
        while not backend.trained and not run.done():  # once it trains, a node of it goes
            time.sleep(0.05)
        node = min(cluster.worker_nodes, key=lambda n: n.node_id)
        removed.append(node.node_id)
        removed_at.append(time.time())
        cluster.remove_node(node, allow_graceful=False)
        cluster.add_node(**NODE)

    with caplog.at_level(logging.WARNING, logger="unified.workers"):
        result = fit_beside(UnifiedTrainer(config, backend=backend), remove_one_then_replace)

    assert removed, "a node was removed while the run trained"
    said = [r.getMessage() for r in caplog.records if "lost with" in r.getMessage()]
    assert said and "they run again" in said[0], "the console says which worker went"
    check_once(result.run_dir, 16, 2)
    assert result.metrics["episodes/errors"] == 0.0
    for group in backend.trained:
        assert sorted(e.rollout_index for e in group.episodes) == list(range(4))
    noticed = min(r.created for r in caplog.records if "lost with" in r.getMessage())
    assert noticed - removed_at[0] < config["trainer"]["stall_timeout_s"], "noticed in time"
    print(f"the removed node's worker was noticed lost {noticed - removed_at[0]:.2f} s later")


@pytest.mark.slow
def test_twenty_random_node_removals_lose_or_repeat_nothing(
    cluster: Cluster, make_config: ConfigFactory
) -> None:
    """The soak: marked slow (minutes on 2 cores); `-m slow` runs it."""
    removals = 20
    backend = RecordingBackend()
    config = cluster_config(make_config, cluster.address, total_steps=240)
    config["workflow"] = "tests.test_cluster:SlowNodeCountdown"
    removed = 0

    def remove_at_random(run: Future[Any]) -> None:
        nonlocal removed
        rng = random.Random(0)
        while not backend.trained and not run.done():  # the workers start first
            time.sleep(0.05)
        while removed < removals and not run.done():
            time.sleep(rng.uniform(0.5, 2.0))
            nodes = sorted(cluster.worker_nodes, key=lambda n: n.node_id)
            cluster.remove_node(rng.choice(nodes), allow_graceful=False)
            cluster.add_node(**NODE)
            removed += 1

    result = fit_beside(UnifiedTrainer(config, backend=backend), remove_at_random)
    check_once(result.run_dir, 240, 2)
    assert result.metrics["episodes/errors"] == 0.0
    assert removed == removals, f"only {removed} nodes were removed during the run"


@ray.remote(num_cpus=0)
class Rank:
    """A stand-in for a verl rank: a call that blocks (a survivor in a collective) or fails."""

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def call(self, seconds: float, fail: bool = False) -> str:
        time.sleep(seconds)
        if fail:
            raise RuntimeError("Connection closed by peer")  # what gloo says when a peer went
        return "done"


def test_the_watched_group_names_a_dead_rank_while_a_survivor_blocks(cluster: Cluster) -> None:
    import threading

    from backends.verl.watch import WatchedWorkerGroup
    from unified.ray_runtime import join_ray

    join_ray(cluster.address)
    ranks = [Rank.remote() for _ in range(2)]
    group = WatchedWorkerGroup.__new__(WatchedWorkerGroup)  # the watch alone, without verl
    group.nodes = ray.get([r.node_id.remote() for r in ranks])

    # Rank 1's process dies mid-call while rank 0 waits for it: the call ends in seconds.
    started = time.monotonic()
    killer = threading.Timer(0.5, ray.kill, [ranks[1]])
    killer.start()
    with pytest.raises(WorkerLostError, match=r"rank 1 of 2 .* during train_step: its worker pro"):
        group._wait("train_step", [ranks[0].call.remote(60), ranks[1].call.remote(60)])
    assert time.monotonic() - started < 30
    killer.join()

    # A rank's own failure, with no rank lost, is that failure as soon as the others replied.
    fresh = [Rank.remote() for _ in range(2)]
    group.nodes = ray.get([r.node_id.remote() for r in fresh])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        group._wait("train_step", [fresh[0].call.remote(0, fail=True), fresh[1].call.remote(1)])
    assert time.monotonic() - started < 10


def test_a_verl_node_removed_mid_run_stops_it_in_one_line_and_resume_continues_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """verl's worker group over both worker nodes (one rank each, gloo on CPU); a node goes
    after the second checkpoint. The run stops within seconds naming the lost rank and the
    checkpoint to go on from; on a replacement node, `resume=true` trains every step once."""
    steps = 6
    sections: dict[str, Any] = {
        "trainer": {
            **countdown_config(tmp_path).trainer.model_dump(),
            "total_steps": steps,
            "save_every": 1,
        },
        "verl": {"num_workers": 2, "forward_batch_size": 4, "ray_address": cluster.address},
    }
    run_dir = tmp_path / "runs" / "verl-e2e"
    removed_at: list[float] = []

    def remove_a_node_after_step_2(run: Future[Any]) -> None:
        def saved() -> list[Path]:  # the trainer keeps the newest few checkpoints
            return [p for p in (run_dir / "checkpoints").glob("step_*") if p.name >= "step_000002"]

        while not saved() and not run.done():
            time.sleep(0.05)
        removed_at.append(time.monotonic())
        node = max(cluster.worker_nodes, key=lambda n: n.node_id)
        cluster.remove_node(node, allow_graceful=False)
        cluster.add_node(**NODE)  # the replacement the resumed run is placed on

    trainer = UnifiedTrainer(countdown_config(tmp_path, **sections))
    with pytest.raises(WorkerLostError, match=r"verl worker rank \d of 2 .* was lost during") as e:
        fit_beside(trainer, remove_a_node_after_step_2)
    stopped_in = time.monotonic() - removed_at[0]

    assert stopped_in < 60, f"the run stopped {stopped_in:.1f} s after its node went"
    notes = getattr(e.value, "__notes__", [])
    assert any("continue with resume=true" in n and "step_0000" in n for n in notes), notes
    print(f"stopped {stopped_in:.1f} s after the node went: {e.value}; {'; '.join(notes)}")

    result = UnifiedTrainer(countdown_config(tmp_path, resume=True, **sections)).fit()
    assert result.steps == steps
    check_once(run_dir, steps, 2)
