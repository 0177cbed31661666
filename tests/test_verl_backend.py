"""verl backend, end to end on CPU: verl's real training worker as a 2-process Ray group (gloo).

Each test starts a private Ray on 127.0.0.1 through the backend and stops it at shutdown. The
model is the built-in tiny Qwen2 (made locally); the tasks are countdown's generator. Starting
the group takes most of a test's time (Ray, then verl imported in each worker): the default run
keeps the backend-level test; the run through `UnifiedTrainer` is marked slow.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.verl.backend import VerlBackend
from examples.countdown.tasks import make_tasks
from examples.countdown.workflow import CountdownWorkflow
from torchkit.sampler import BatchingSampler
from unified import UnifiedTrainer
from unified.config import TrainerConfig, load_config
from unified.rollout import SamplingEngine
from unified.sequences import sequences_of
from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup


def countdown_config(tmp_path: Path, **sections: Any) -> TrainerConfig:
    base: dict[str, Any] = {
        "name": "verl-e2e",
        "backend": "verl",
        "mode": "sync",
        "workflow": "examples.countdown.workflow:CountdownWorkflow",
        "model": "builtin:tiny",
        "data": {
            "train": {"generator": "examples.countdown.tasks:make_tasks", "n": 64},
        },
        "trainer": {
            "total_steps": 2,
            "batch_size": 2,
            "group_size": 4,
            "lr": 1e-3,
            # A random model earns no countdown reward: the entropy bonus still gives a gradient.
            "entropy_coef": 0.01,
            "filter_groups": False,
            "eval_every": 0,
            "eval_before_train": False,
            "save_every": 2,
            "stall_timeout_s": 600,
            "workflow_timeout_s": 120,
        },
        "sampling": {"train": {"temperature": 1.0, "max_tokens": 8}},
        "verl": {"num_workers": 2, "forward_batch_size": 4},
        "logging": {"run_dir": str(tmp_path / "runs"), "console": False},
    }
    return load_config(base | sections)


@pytest.mark.slow
def test_countdown_trains_two_steps_on_the_cpu_worker_group_and_checkpoints_in_verls_layout(
    tmp_path: Path,
) -> None:
    result = UnifiedTrainer(countdown_config(tmp_path)).fit()

    assert result.steps == 2
    for key in ("train/loss", "train/grad_norm", "train/kl_sample_train", "time/sync"):
        assert key in result.metrics, f"{key} missing from the last step's metrics"
    assert result.metrics["train/grad_norm"] > 0, "the workers computed a gradient (entropy bonus)"
    backend_dir = result.run_dir / "checkpoints" / "step_000002" / "backend"
    assert (backend_dir / "latest_checkpointed_iteration.txt").read_text() == "2"
    actor = backend_dir / "global_step_2" / "actor"
    shards = sorted(p.name for p in actor.glob("model_world_size_2_rank_*.pt"))
    assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    assert (result.run_dir / "verl" / "verl_config.yaml").exists(), "the composed verl config"


async def rollout_groups(backend: VerlBackend, seed: int) -> list[TrajectoryGroup]:
    """Two groups of four countdown rollouts from the backend's sampler, advantages +-1."""
    engine = SamplingEngine(backend.token_sampler())
    workflow = CountdownWorkflow()
    groups = []
    for g, task in enumerate(make_tasks(2, seed=seed)):
        prompts = [engine.encode_chat(workflow.messages(task))] * 4
        outputs: list[ModelOutput] = await asyncio.gather(
            *[
                engine.complete(
                    p, temperature=1.0, top_p=1.0, max_tokens=8, stop=[], seed=g * 4 + i
                )
                for i, p in enumerate(prompts)
            ]
        )
        episodes = [
            Episode(
                task_id=task.id,
                rollout_index=i,
                trajectories=[Trajectory(steps=[Step(output=o)], reward=0.0)],
            )
            for i, o in enumerate(outputs)
        ]
        groups.append(
            TrajectoryGroup(
                task_id=task.id,
                episodes=episodes,
                advantages=[1.0, -1.0, 1.0, -1.0],
                policy_version=0,
                group_id=f"g{g}",
            )
        )
    return groups


def sampled(groups: list[TrajectoryGroup]) -> list[list[float]]:
    return [
        s.output.logprobs
        for g in groups
        for e in g.episodes
        for t in e.trajectories
        for s in t.steps
    ]


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


async def test_weight_sync_checkpoints_and_the_kl_reference_on_the_cpu_worker_group(
    tmp_path: Path,
) -> None:
    # One Ray start for the whole update path: train with a KL penalty, sync, save, load.
    config = countdown_config(tmp_path)
    config.trainer.kl_coef = 0.5
    config.mode, config.async_.partial_rollout = "async", True  # what async mode resolves to
    backend = VerlBackend()
    await backend.setup(config)
    try:
        # The driver's sampler cuts running requests at a sync (the sampler's own tests).
        assert isinstance(backend.sampler, BatchingSampler) and backend.sampler.partial_rollout
        before = await rollout_groups(backend, seed=1)
        assert max_gap(await backend.score(before), sampled(before)) < 1e-4, (
            "before training, the workers and the sampler hold the same weights"
        )
        # 5 rows in micro-batches of 2 on 2 workers: 3 loss-free rows, one in each of the last
        # three micro-batches; every row's scores still come back to it.
        one = {"episodes": before[1].episodes[:1], "advantages": before[1].advantages[:1]}
        odd = [before[0], before[1].model_copy(update=one)]
        settings = backend.settings
        backend.settings = settings.model_copy(update={"forward_batch_size": 2})
        assert max_gap(await backend.score(odd), sampled(odd)) < 1e-4, "scores in row order"
        backend.settings = settings
        reference_before = await backend.score(before, reference=True)
        assert max_gap(reference_before, sampled(before)) < 1e-4, (
            "the reference starts from the policy's initial weights"
        )
        kls = []
        for _ in range(2):
            await backend.forward_backward(before)
            metrics = await backend.optim_step()
            assert metrics["train/grad_norm"] > 0
            kls.append(metrics["train/kl_reference"])
        assert kls[0] == pytest.approx(0.0, abs=1e-6), "no KL before the policy moves"
        assert kls[1] > 1e-6, "the second step is penalised for leaving the reference"
        assert max_gap(await backend.score(before), sampled(before)) > 1e-3, (
            "training moved the policy"
        )
        assert max_gap(await backend.score(before, reference=True), reference_before) < 1e-6, (
            "the reference stays frozen while the policy trains"
        )

        await backend.on_policy_updated(1)
        after = await rollout_groups(backend, seed=2)
        assert all(
            o.output.policy_version == 1
            for g in after
            for e in g.episodes
            for t in e.trajectories
            for o in t.steps
        )
        workers_after = await backend.score(after)
        assert max_gap(workers_after, sampled(after)) < 1e-4, (
            "after the sync the sampler scores like the workers"
        )
        # Under bf16 mixed precision (a GPU's default) the sync sends the weights cast to bf16.
        full = backend.group.export_weights(backend.tied)
        halved = backend.group.export_weights(backend.tied, torch.bfloat16)
        assert all(halved[n].dtype == torch.bfloat16 for n in halved)
        assert all(torch.equal(halved[n], full[n].to(torch.bfloat16)) for n in full)

        checkpoint = tmp_path / "ckpt"
        checkpoint.mkdir()
        await backend.save_checkpoint(checkpoint)
        await backend.forward_backward(after)
        await backend.optim_step()
        assert max_gap(await backend.score(after), workers_after) > 1e-3, (
            "a third step moved the policy"
        )
        await backend.load_checkpoint(checkpoint)
        assert max_gap(await backend.score(after), workers_after) < 1e-5, (
            "loading restored the workers"
        )
        assert backend.sampler.version == 1
    finally:
        await backend.shutdown()


def test_a_worker_group_the_cluster_cannot_place_is_refused_in_one_line() -> None:
    from backends.verl.worker_group import PolicyGroup
    from unified.errors import BackendError

    group = PolicyGroup(None, None, num_workers=4, device="cpu", ray_address=None)
    with pytest.raises(BackendError, match=r"num_workers=4 needs 4 CPUs free .*, which has 2"):
        group._check_resources({"CPU": 2.0})
    group._check_resources({"CPU": 4.0})


def test_a_checkpoint_of_another_number_of_workers_is_refused_in_one_line() -> None:
    from backends.verl.backend import check_saved_workers
    from unified.errors import UsageError

    check_saved_workers({"num_workers": 2}, 2)
    check_saved_workers({}, 2)  # written before the count was recorded: nothing to compare
    with pytest.raises(UsageError, match=r"holds 4 workers' shards; resume with .*=4"):
        check_saved_workers({"num_workers": 4}, 2)


def test_a_group_larger_than_a_node_is_split_into_node_sized_groups_or_refused() -> None:
    """verl packs each placement group on one node: one group of 16 on two 8-GPU nodes would
    wait for its bundles forever."""
    from backends.verl.worker_group import placement
    from unified.errors import BackendError

    assert placement(2, [2.0], "CPU") == [2]
    assert placement(8, [8.0, 8.0], "GPU") == [8]
    assert placement(16, [8.0, 8.0], "GPU") == [8, 8]
    with pytest.raises(BackendError, match=r"num_workers=12 must fit one node or be a multiple"):
        placement(12, [8.0, 8.0], "GPU")
    with pytest.raises(BackendError, match=r"with as many nodes that size"):
        placement(16, [8.0, 4.0, 4.0], "GPU")  # a second group of 8 fits no node


def test_greedy_and_temperature_1_rows_score_together_and_other_mixes_are_refused() -> None:
    from unified.errors import BackendError

    backend = VerlBackend()
    backend.config = load_config({"workflow": "x:y", "backend": "verl"})

    def rows(*temperatures: float | None) -> list[Any]:
        calls = [
            ModelOutput(
                text="",
                prompt_ids=[1],
                completion_ids=[2],
                logprobs=[-1.0],
                finish_reason="stop",
                policy_version=0,
                temperature=t,
            )
            for t in temperatures
        ]
        trajectories = [Trajectory(steps=[Step(output=o)], reward=0.0) for o in calls]
        episodes = [Episode(task_id="t", rollout_index=0, trajectories=trajectories)]
        group = TrajectoryGroup(task_id="t", episodes=episodes, advantages=[0.0], policy_version=0)
        return sequences_of([group], loss="ppo", temperature=1.0)

    assert backend._temperature(rows(0.0, 1.0, None)) == 1.0
    assert backend._temperature(rows(0.7, 0.7)) == 0.7
    with pytest.raises(BackendError, match=r"mixes sampling temperatures \[0\.7, 1\.0\]"):
        backend._temperature(rows(0.7, 0.0))


async def test_a_stuck_worker_call_does_not_keep_shutdown_from_stopping_the_group() -> None:
    """The calls run one at a time on one thread: a shutdown queued behind a stuck call would
    never stop the workers, the placement groups or a private Ray."""
    import threading

    from backends.verl.config import VerlConfig
    from unified.errors import BackendError

    class StuckGroup:
        release = threading.Event()
        stopped = False

        def train(self) -> None:
            self.release.wait(60)

        def shutdown(self) -> None:
            self.stopped = True

    backend = VerlBackend()
    backend.settings = VerlConfig(call_timeout_s=0.5)
    group = StuckGroup()
    backend._group = group  # type: ignore[assignment]
    try:
        with pytest.raises(BackendError, match=r"a training step took more than 0\.5 s"):
            await backend._call("a training step", group.train)
        await backend.shutdown()
        assert group.stopped and backend._group is None
        # The trainer's own deadline (trainer.backend_timeout_s) cancels the call instead.
        patient = VerlBackend()
        patient.settings = VerlConfig(call_timeout_s=60)
        second = StuckGroup()
        patient._group = second  # type: ignore[assignment]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(patient._call("a training step", second.train), 0.3)
        await patient.shutdown()
        assert second.stopped and patient._group is None
    finally:
        group.release.set()
