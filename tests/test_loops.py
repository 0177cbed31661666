"""The guarantees of the sync and async loops, checked on the bandit test backend."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ConfigFactory
from unified import UnifiedTrainer
from unified.checkpoint import LedgerEntry, RunDirectory
from unified.errors import UsageError
from unified.groups import RUN_ENDED
from unified.metrics import METRIC_NAMES
from unified.protocol import BackendCapabilities, RolloutEngine
from unified.testing import BanditBackend, bandit_tasks, heavy_tailed_latency, multi_call_workflow
from unified.trainer import TrainingStopped
from unified.types import Step, Task, Trajectory, TrajectoryGroup


def fit(config: dict[str, Any], backend: BanditBackend, workflow: Any = None, **kw: Any) -> Any:
    kw.setdefault("train_tasks", bandit_tasks(24))
    return UnifiedTrainer(config, workflow=workflow, backend=backend, **kw).fit()


def ledger(run_dir: Path) -> list[LedgerEntry]:
    return RunDirectory(run_dir).read_ledger()


def metrics_lines(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained(entries: list[LedgerEntry]) -> list[tuple[str, int]]:
    return [(e.group_id, e.step) for e in entries if e.outcome == "trained"]


def seqs(entries: list[LedgerEntry]) -> list[int]:
    return [int(re.match(r"g(\d+)-", e.group_id).group(1)) for e in entries]  # type: ignore[union-attr]


PARTIAL = BackendCapabilities(partial_rollout=True)
_RUN_NUMBERS = itertools.count()


class VersionCheckingBandit(BanditBackend):
    """Checks that each trained group's version is the oldest version of any of its tokens."""

    spanning_requests = 0  # requests whose tokens came from more than one version

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        for group in groups:
            outputs = [s.output for e in group.episodes for t in e.trajectories for s in t.steps]
            oldest = min(o.oldest_version for o in outputs)
            assert group.policy_version <= oldest, f"{group.group_id} is newer than its tokens"
            assert group.policy_version >= min(e.policy_version for e in group.episodes)
            for o in outputs:
                if o.token_versions is None:
                    continue
                assert o.token_versions == sorted(o.token_versions), "versions only go forward"
                assert o.token_versions[0] == o.policy_version, "first token at dispatch version"
                self.spanning_requests += len(set(o.token_versions)) > 1
        return await super().forward_backward(groups)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    staleness=st.integers(0, 3),
    sync_every=st.integers(1, 3),
    batch_size=st.integers(1, 3),
    group_size=st.integers(2, 3),
    partial=st.booleans(),
    seed=st.integers(0, 10_000),
    micro=st.sampled_from([None, 1]),
    calls=st.integers(1, 3),
)
def test_async_never_trains_a_group_staler_than_max_staleness(
    make_config: ConfigFactory,
    tmp_path: Path,
    staleness: int,
    sync_every: int,
    batch_size: int,
    group_size: int,
    partial: bool,
    seed: int,
    micro: int | None,
    calls: int,
) -> None:
    name = f"s{staleness}k{sync_every}b{batch_size}g{group_size}p{partial}x{seed}m{micro}c{calls}"
    name += f"-{next(_RUN_NUMBERS)}"  # hypothesis may replay an example while shrinking
    config = make_config(
        name=name,
        mode="async",
        trainer={
            "total_steps": 6,
            "batch_size": batch_size,
            "group_size": group_size,
            "seed": seed,
            "micro_batch_size": micro,
            # Slow learning: a policy collapsed onto one arm makes every group filtered.
            "lr": 0.05,
        },
        async_={
            "max_staleness": staleness,
            "sync_every": sync_every,
            "partial_rollout": partial,
            "strict_staleness": True,
        },
    )
    backend = VersionCheckingBandit(latency=heavy_tailed_latency(), capabilities=PARTIAL)
    # Several model calls per episode: an episode may span weight syncs.
    result = fit(config, backend, workflow=multi_call_workflow(calls))
    entries = ledger(result.run_dir)
    done = [e for e in entries if e.outcome == "trained"]
    assert len(done) == 6 * batch_size, "every step trains batch_size groups"
    for e in done:
        lag = e.trainer_version - e.policy_version
        assert 0 <= lag <= staleness, f"{e.group_id} trained {lag} versions stale (s={staleness})"
    assert sorted(seqs(entries)) == list(range(len(entries))), "each group ends exactly once"


class ThirdSyncBandit(BanditBackend):
    """Sets `third_sync` once the weights reach version 3."""

    def __init__(self) -> None:
        super().__init__()
        self.third_sync = asyncio.Event()

    async def on_policy_updated(self, version: int) -> None:
        await super().on_policy_updated(version)
        if version >= 3:
            self.third_sync.set()


def test_stragglers_past_their_deadline_are_requeued_and_their_tasks_trained_later(
    make_config: ConfigFactory,
) -> None:
    """The first two groups' workflows hang until version 3; with max_staleness 1 the trainer
    trains the over-admitted groups instead, and requeues the two when their deadline passes."""
    config = make_config(
        name="requeue",
        mode="async",
        trainer={"total_steps": 8, "batch_size": 2, "group_size": 2, "lr": 0.05},
        async_={"max_staleness": 1, "strict_staleness": True, "over_admit": 1.0},
    )
    backend = ThirdSyncBandit()
    stragglers: list[str] = []

    async def workflow(task: Task, model: RolloutEngine) -> Trajectory:
        if len(stragglers) < 2 and task.id not in stragglers:
            stragglers.append(task.id)
        if task.id in stragglers and not backend.third_sync.is_set():
            async with asyncio.timeout(30):
                await backend.third_sync.wait()
        out = await model.chat([{"role": "user", "content": task.id}])
        reward = float(out.text == str(task.data["target"]))
        return Trajectory(steps=[Step(output=out, reward=reward)], reward=reward)

    result = fit(config, backend, workflow=workflow)
    entries = ledger(result.run_dir)
    requeued = [e for e in entries if e.outcome == "requeued"]
    assert [e.task_id for e in requeued[:2]] == stragglers, f"requeued: {requeued}"
    # A task requeued near the end may wait for the next run: the final checkpoint keeps it.
    waiting = RunDirectory.load_state(result.run_dir / "checkpoints" / "step_000008").redispatch
    for gone in requeued:  # (a group over-admitted for them may expire ready later: waste)
        assert RUN_ENDED not in gone.reason or gone.step == 8, f"{gone} outlived the run early"
        if gone.step == 8 or gone.task_id in waiting:
            continue  # an extended run dispatches it first
        seq = seqs([gone])[0]
        later = [e for e in entries if e.task_id == gone.task_id and seqs([e])[0] > seq]
        ended = [e.outcome != "requeued" or e.step == 8 for e in later]
        assert any(ended), f"{gone.group_id}'s task must be dispatched again and end: {later}"
    assert sorted(seqs(entries)) == list(range(len(entries))), "each group ends exactly once"
    for e in entries:
        lag = e.trainer_version - e.policy_version
        assert e.outcome != "trained" or lag <= 1, f"{e.group_id} trained {lag} versions stale"
    # A group still alive as the run ends is the final checkpoint's work in flight
    # (episodes/in_flight_at_end), not thrown away: only the late ones count as thrown.
    late = [e for e in requeued if RUN_ENDED not in e.reason]
    lines = metrics_lines(result.run_dir)
    thrown = sum(m["episodes/discarded"] + m["episodes/cancelled"] for m in lines)
    assert thrown >= 2 * len(late), "the requeued groups' episodes are reported"
    assert sum(m["groups/requeued"] for m in lines) == len(requeued)


def test_partial_rollout_requests_span_weight_syncs(make_config: ConfigFactory) -> None:
    """Requests cut by a sync keep their first token's version; the staleness bound holds."""
    config = make_config(
        name="spanning",
        mode="async",
        trainer={"total_steps": 6, "batch_size": 2, "group_size": 3},
        async_={"max_staleness": 1, "sync_every": 1, "partial_rollout": True},
    )

    async def until_a_sync(seed: int) -> None:
        """Hold a request's end token until the next weight sync (or 0.5 s: a loaded host's
        trainer can take longer than any fixed number of event-loop turns)."""
        start = backend.sampler_version
        for _ in range(500):  # >= 0.5 s: each sleep lasts at least its 1 ms
            if backend.sampler_version != start:
                return
            await asyncio.sleep(0.001)

    backend = VersionCheckingBandit(
        latency=heavy_tailed_latency(), capabilities=PARTIAL, end_latency=until_a_sync
    )
    result = fit(config, backend, workflow=multi_call_workflow(2))
    assert backend.spanning_requests > 0, "no request spanned a weight sync"
    for e in ledger(result.run_dir):
        assert e.outcome != "trained" or e.trainer_version - e.policy_version <= 1, e.group_id


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_async_with_zero_staleness_trains_exactly_what_sync_trains(
    make_config: ConfigFactory, seed: int
) -> None:
    """Without over-admission (which only async mode does), the two modes are one loop."""
    runs = {}
    for mode in ("sync", "async"):
        config = make_config(
            name=mode,
            mode=mode,
            trainer={"total_steps": 6, "batch_size": 3, "group_size": 3, "seed": seed},
            async_={"max_staleness": 0, "sync_every": 1, "strict_staleness": True, "over_admit": 0},
        )
        backend = BanditBackend(latency=heavy_tailed_latency())
        result = fit(config, backend)
        runs[mode] = (ledger(result.run_dir), backend)
    (sync_ledger, sync_backend), (async_ledger, async_backend) = runs["sync"], runs["async"]
    assert trained(async_ledger) == trained(sync_ledger), "same groups, same steps, same order"
    assert sorted(e.model_dump_json() for e in async_ledger) == sorted(
        e.model_dump_json() for e in sync_ledger
    ), "same filtered groups too"
    assert async_backend.events == sync_backend.events, "same calls in the same order"
    assert async_backend.train_logits == sync_backend.train_logits, "same final weights"


def test_all_filtered_groups_end_the_run_with_a_clear_message(make_config: ConfigFactory) -> None:
    async def never_rewarded(task: Task, model: RolloutEngine) -> Trajectory:
        out = await model.chat([{"role": "user", "content": "x"}])
        return Trajectory(steps=[Step(output=out)], reward=0.0)

    for mode in ("sync", "async"):
        config = make_config(name=mode, mode=mode, trainer={"max_filtered_in_a_row": 12})
        backend = BanditBackend()
        with pytest.raises(TrainingStopped, match=r"filtered .* before any step trained"):
            fit(config, backend, workflow=never_rewarded)
        assert not [e for e in backend.events if e[0] == "optim_step"], "zero trained steps"
        assert backend.shutdown_called
        run_dir = Path(config["logging"]["run_dir"]) / mode
        assert not run_dir.exists(), "a run that trained nothing leaves no directory to rerun over"


def test_groups_that_fail_stop_the_run_naming_the_workflow_not_the_reward(
    make_config: ConfigFactory,
) -> None:
    async def broken(task: Task, model: RolloutEngine) -> Trajectory:
        raise RuntimeError("the tool server is down")

    config = make_config(trainer={"max_filtered_in_a_row": 12, "max_error_rate": 1.0})
    with pytest.raises(TrainingStopped, match=r"most of them failed.*episodes/errors"):
        fit(config, BanditBackend(), workflow=broken)


@pytest.mark.parametrize("save_final", [True, False])
def test_a_run_keeps_its_final_policy_unless_told_not_to(
    make_config: ConfigFactory, save_final: bool
) -> None:
    config = make_config(trainer={"total_steps": 3, "save_every": 0, "save_final": save_final})
    result = fit(config, BanditBackend())
    saved = sorted(p.name for p in (result.run_dir / "checkpoints").glob("step_*"))
    assert saved == (["step_000003"] if save_final else [])


def test_equal_rewards_after_training_stop_the_run_as_a_collapse(
    make_config: ConfigFactory,
) -> None:
    # Rewards differ within groups for the first 3 steps (8 episodes each), then never again:
    # the advice is about the policy's collapse, not the workflow's reward.
    episodes = itertools.count()

    async def rewarded_at_first(task: Task, model: RolloutEngine) -> Trajectory:
        out = await model.chat([{"role": "user", "content": "x"}])
        n = next(episodes)
        return Trajectory(steps=[Step(output=out)], reward=float(n % 2) if n < 24 else 0.0)

    config = make_config(trainer={"total_steps": 20, "max_filtered_in_a_row": 12})
    with pytest.raises(TrainingStopped) as stopped:
        fit(config, BanditBackend(), workflow=rewarded_at_first)
    message = str(stopped.value)
    assert "after 3 trained steps: the policy has collapsed" in message
    assert "train/entropy" in message and "trainer.entropy_coef" in message
    assert "filter_groups" not in message


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_keep_per_group_trains_the_most_spread_rollouts_in_both_loops(
    make_config: ConfigFactory, mode: str
) -> None:
    class Recording(BanditBackend):
        sizes: list[int] = []
        trained_rewards: list[float] = []

        async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
            for group in groups:
                self.sizes.append(len(group.episodes))
                self.trained_rewards += [e.reward for e in group.episodes]
            return await super().forward_backward(groups)

    config = make_config(
        name=mode, mode=mode, trainer={"total_steps": 3, "group_size": 6, "keep_per_group": 2}
    )
    backend = Recording()
    fit(config, backend)
    assert backend.sizes and set(backend.sizes) == {2}, backend.sizes
    run_dir = Path(config["logging"]["run_dir"]) / mode
    steps = [m for m in metrics_lines(run_dir) if "reward/mean" in m]
    assert len(steps) == 3
    # Of 0/1 rewards, the pair that spreads most is one of each.
    assert backend.trained_rewards.count(0.0) == backend.trained_rewards.count(1.0)


def test_every_dispatched_group_ends_once_with_filtering_and_errors(
    make_config: ConfigFactory,
) -> None:
    async def flaky(task: Task, model: RolloutEngine) -> Trajectory:
        out = await model.chat([{"role": "user", "content": task.id}])
        if task.data["target"] == 3 and out.text != "3":  # a quarter of the tasks, most tries
            raise RuntimeError("tool crashed")
        reward = float(out.text == str(task.data["target"]))
        return Trajectory(steps=[Step(output=out, reward=reward)], reward=reward)

    config = make_config(
        mode="async",
        # A slow learner: a policy collapsed onto one arm leaves only filtered or failed groups.
        trainer={"total_steps": 8, "max_error_rate": 0.5, "group_size": 2, "lr": 0.1},
        async_={"max_staleness": 2},
    )
    result = fit(config, BanditBackend(latency=heavy_tailed_latency()), workflow=flaky)
    entries = ledger(result.run_dir)
    outcomes = {e.outcome for e in entries}
    assert {"trained", "filtered", "failed"} <= outcomes, f"exercise all outcomes: {outcomes}"
    assert sorted(seqs(entries)) == list(range(len(entries))), "each group ends exactly once"
    lines = metrics_lines(result.run_dir)
    assert sum(m.get("episodes/errors", 0) for m in lines) > 0, "errors are counted"


def test_error_rate_above_the_limit_reraises_the_original_exception(
    make_config: ConfigFactory,
) -> None:
    class Boom(Exception):
        pass

    async def broken(task: Task, model: RolloutEngine) -> Trajectory:
        raise Boom("the environment is down")

    for mode in ("sync", "async"):
        backend = BanditBackend()
        with pytest.raises(Boom, match="the environment is down") as info:
            fit(make_config(name=mode, mode=mode), backend, workflow=broken)
        assert any("max_error_rate" in note for note in info.value.__notes__)
        assert backend.shutdown_called


def test_workflow_past_timeout_is_counted_as_a_timeout(make_config: ConfigFactory) -> None:
    async def stuck_on_one_task(task: Task, model: RolloutEngine) -> Trajectory:
        out = await model.chat([{"role": "user", "content": task.id}])
        if task.id == "t5":
            await asyncio.Event().wait()
        reward = float(out.text == str(task.data["target"]))
        return Trajectory(steps=[Step(output=out, reward=reward)], reward=reward)

    config = make_config(
        mode="async", trainer={"workflow_timeout_s": 0.2, "max_error_rate": 0.5, "total_steps": 6}
    )
    tasks = bandit_tasks(6)
    result = fit(config, BanditBackend(), workflow=stuck_on_one_task, train_tasks=tasks)
    lines = metrics_lines(result.run_dir)
    assert sum(m.get("episodes/timeouts", 0) for m in lines) > 0
    failed = [e for e in ledger(result.run_dir) if e.outcome == "failed"]
    assert failed and all(e.task_id == "t5" for e in failed), "only the stuck task fails"


class SyncSignallingBandit(BanditBackend):
    """Sets `synced[v]` when version `v` becomes visible to sampling."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.synced = {version: asyncio.Event() for version in range(1, 16)}

    async def on_policy_updated(self, version: int) -> None:
        await super().on_policy_updated(version)
        self.synced[version].set()


@pytest.mark.parametrize("strict", [False, True])
def test_weight_sync_never_waits_for_running_workflows(
    make_config: ConfigFactory, strict: bool
) -> None:
    backend = SyncSignallingBandit()
    held: list[list[int]] = []

    async def first_one_waits_for_a_sync(task: Task, model: RolloutEngine) -> Trajectory:
        messages = [{"role": "user", "content": f"pick {task.data['target']}"}]
        first = await model.chat(messages)
        steps = [Step(messages=messages, output=first)]
        if not held:
            held.append([])
            # A trainer that drained workflows before syncing would deadlock here.
            async with asyncio.timeout(10):
                await backend.synced[1].wait()
            steps.append(Step(messages=messages, output=await model.chat(messages)))
            held[0] = [s.output.policy_version for s in steps]
        reward = float(steps[-1].output.text == str(task.data["target"]))
        return Trajectory(steps=steps, reward=reward)

    config = make_config(
        mode="async",
        trainer={
            "total_steps": 6,
            "stall_timeout_s": 5,
            "workflow_timeout_s": 4,
            "filter_groups": False,
        },
        async_={"max_staleness": 1, "sync_every": 1, "strict_staleness": strict},
    )
    result = fit(config, backend, workflow=first_one_waits_for_a_sync)
    assert held == [[0, 1]], (
        "the held episode finished after the sync to v1, its steps recording the version each "
        "call came from"
    )
    entries = ledger(result.run_dir)
    if strict:
        trained_lines = [e for e in entries if e.outcome == "trained"]
        assert all(0 <= e.trainer_version - e.policy_version <= 1 for e in trained_lines)
    else:
        late = [e for e in entries if e.outcome == "requeued" and RUN_ENDED not in e.reason]
        assert not late, f"by default nothing is requeued for being late: {late}"
        assert held[0][0] in {e.policy_version for e in entries if e.outcome == "trained"}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("sync_every", [1, 2, 3])
def test_weights_sync_exactly_every_k_optimizer_steps(
    make_config: ConfigFactory, mode: str, sync_every: int
) -> None:
    config = make_config(mode=mode, trainer={"total_steps": 6}, async_={"sync_every": sync_every})
    backend = BanditBackend()
    fit(config, backend)
    kinds = [e[0] for e in backend.events if e[0] != "forward_backward"]
    expected = (["optim_step"] * sync_every + ["on_policy_updated"]) * (6 // sync_every)
    assert kinds == expected
    versions = [e[1] for e in backend.events if e[0] == "on_policy_updated"]
    assert versions == list(range(1, 6 // sync_every + 1))


def test_eval_during_async_run_does_not_change_training_sampling(
    make_config: ConfigFactory,
) -> None:
    config = make_config(
        mode="async",
        trainer={"total_steps": 6, "eval_every": 2, "eval_before_train": True},
        sampling={
            "train": {"temperature": 1.0, "max_tokens": 64},
            "eval": {"temperature": 0.0, "max_tokens": 7},
        },
    )
    backend = BanditBackend(latency=heavy_tailed_latency())
    fit(config, backend, eval_tasks=bandit_tasks(5, prefix="e"))
    kinds = [(r["temperature"], r["max_tokens"]) for r in backend.requests]
    assert set(kinds) == {(1.0, 64), (0.0, 7)}, f"only train or eval settings: {set(kinds)}"
    assert kinds.count((0.0, 7)) == 5 * 4, "eval before training and at steps 2, 4, 6"
    first_eval_end = max(i for i, k in enumerate(kinds[:40]) if k == (0.0, 7))
    assert (1.0, 64) in kinds[first_eval_end:], "training requests follow an evaluation"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_fit_leaves_no_task_running_and_shuts_the_backend_down(
    make_config: ConfigFactory, mode: str
) -> None:
    backend = BanditBackend(latency=heavy_tailed_latency())
    config = make_config(mode=mode, async_={"max_staleness": 3})
    trainer = UnifiedTrainer(config, backend=backend, train_tasks=bandit_tasks(24))
    async with asyncio.timeout(60):
        await trainer.fit_async()
    assert asyncio.all_tasks() == {asyncio.current_task()}, "no task outlives fit"
    assert backend.shutdown_called


async def test_fit_that_raises_leaves_no_task_running(make_config: ConfigFactory) -> None:
    async def broken(task: Task, model: RolloutEngine) -> Trajectory:
        await model.chat([{"role": "user", "content": "x"}])
        raise ValueError("bad reward")

    backend = BanditBackend(latency=heavy_tailed_latency())
    trainer = UnifiedTrainer(
        make_config(mode="async"), workflow=broken, backend=backend, train_tasks=bandit_tasks(8)
    )
    with pytest.raises(ValueError, match="bad reward"):
        async with asyncio.timeout(60):
            await trainer.fit_async()
    assert asyncio.all_tasks() == {asyncio.current_task()}, "no task outlives a failed fit"
    assert backend.shutdown_called


@pytest.mark.parametrize("batch_size", [1, 4])
def test_learning_rate_schedule_counts_optimizer_steps(
    make_config: ConfigFactory, batch_size: int
) -> None:
    config = make_config(
        mode="async",
        trainer={
            "total_steps": 5,
            "batch_size": batch_size,
            "lr": 1.0,
            "lr_schedule": "linear",
            "warmup_steps": 1,
        },
    )
    backend = BanditBackend()
    fit(config, backend)
    lrs = [e[1] for e in backend.events if e[0] == "optim_step"]
    assert lrs == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25]), "one value per optimizer step"


@pytest.mark.parametrize(
    ("decay_steps", "expected"),
    [(4, [1.0] * 6 + [1.0, 0.75, 0.5, 0.25]), (None, [1.0] * 8 + [1.0, 0.5])],  # None: a fifth
)
def test_wsd_holds_the_peak_then_decays_over_the_last_steps(
    make_config: ConfigFactory, decay_steps: int | None, expected: list[float]
) -> None:
    trainer = {"total_steps": 10, "lr": 0.01, "lr_schedule": "wsd", "decay_steps": decay_steps}
    backend = BanditBackend()
    fit(make_config(mode="sync", trainer=trainer), backend)
    lrs = [e[1] / 0.01 for e in backend.events if e[0] == "optim_step"]
    assert lrs == pytest.approx(expected)


def test_metrics_jsonl_uses_the_contract_names(make_config: ConfigFactory) -> None:
    config = make_config(mode="async", trainer={"eval_every": 2, "total_steps": 4})
    result = fit(config, BanditBackend(), eval_tasks=bandit_tasks(3, prefix="e"))
    lines = metrics_lines(result.run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(type(m["step"]) is int for m in lines), "steps are written as integers"
    for m in lines:
        missing = set(METRIC_NAMES) - set(m) - {"eval/accuracy"}
        assert not missing, f"step {m['step']} lacks {sorted(missing)}"
    assert all("eval/accuracy" in m for m in lines if m["step"] % 2 == 0)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rollout_rates_cover_the_time_a_slow_save_takes(
    make_config: ConfigFactory, mode: str
) -> None:
    class SlowSave(BanditBackend):
        async def save_checkpoint(self, directory: Path) -> None:
            await asyncio.sleep(0.2)
            await super().save_checkpoint(directory)

    config = make_config(mode=mode, trainer={"total_steps": 3, "save_every": 1})
    lines = metrics_lines(fit(config, SlowSave()).run_dir)
    for m in lines[1:]:  # each after a 0.2 s save, in which the next groups were generated
        assert m["rollout/idle_ratio"] <= 1.0
        # At most two windows of 2 groups x 4 episodes x 2 tokens in an interval of >= 0.2 s.
        assert m["throughput/tokens_per_s"] <= 2 * 2 * 4 * 2 / 0.2


def test_the_metrics_sinks_close_when_the_backend_shutdown_or_the_loop_set_up_fails(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unified.errors import DataError
    from unified.metrics import MetricsAggregator

    closed: list[MetricsAggregator] = []
    close = MetricsAggregator.close
    monkeypatch.setattr(MetricsAggregator, "close", lambda self: (closed.append(self), close(self)))

    class FailingShutdown(BanditBackend):
        async def shutdown(self) -> None:
            raise RuntimeError("shutdown failed")

    with pytest.raises(RuntimeError, match="shutdown failed"):
        fit(make_config(trainer={"total_steps": 1}), FailingShutdown())
    assert len(closed) == 1
    with pytest.raises(DataError, match="empty dataset"):
        fit(make_config(name="empty"), BanditBackend(), train_tasks=[])
    assert len(closed) == 2, "the sinks opened before the loop failed to set up"


def test_a_failed_shutdown_is_noted_on_the_error_that_ends_the_run(
    make_config: ConfigFactory,
) -> None:
    async def broken(task: Task, model: RolloutEngine) -> Trajectory:
        raise ValueError("the workflow is broken")

    class FailingShutdown(BanditBackend):
        async def shutdown(self) -> None:
            raise RuntimeError("shutdown failed")

    with pytest.raises(ValueError, match="the workflow is broken") as raised:
        fit(make_config(trainer={"total_steps": 2}), FailingShutdown(), workflow=broken)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "shutdown also failed" in notes, f"the shutdown's failure must not be lost: {notes!r}"


def test_a_second_fit_refused_for_an_existing_run_leaves_the_first_run_in_place(
    make_config: ConfigFactory,
) -> None:
    trainer = UnifiedTrainer(
        make_config(trainer={"total_steps": 1}),
        backend=BanditBackend(),
        train_tasks=bandit_tasks(8),
    )
    run_dir = trainer.fit().run_dir
    with pytest.raises(UsageError, match="already holds a run"):
        trainer.fit()
    assert (run_dir / "ledger.jsonl").exists(), "the finished run must survive a refused refit"


def test_resuming_with_another_model_is_refused_and_leaves_the_run_as_it_was(
    make_config: ConfigFactory,
) -> None:
    config = make_config(model="first", trainer={"total_steps": 2, "save_every": 1})
    run_dir = fit(config, BanditBackend()).run_dir
    written = (run_dir / "config.yaml").read_text()
    with pytest.raises(UsageError, match="was trained with model='first', but the config says"):
        fit({**config, "resume": True, "model": "second"}, BanditBackend())
    assert (run_dir / "config.yaml").read_text() == written


def test_resuming_with_another_spelling_of_the_model_directory_is_accepted(
    make_config: ConfigFactory, tmp_path: Path
) -> None:
    (tmp_path / "model").mkdir()
    config = make_config(model=str(tmp_path / "model"), trainer={"total_steps": 2, "save_every": 1})
    fit(config, BanditBackend())
    respelled = {**config, "resume": True, "model": f"{tmp_path}/./model/"}
    respelled["trainer"] = {**config["trainer"], "total_steps": 3}
    assert fit(respelled, BanditBackend()).steps == 3


def test_a_failing_metrics_write_ends_the_run_and_checkpoints_hold_written_lines(
    make_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Metrics are written off the training path: a write that fails still ends the run, and
    # the lines of the steps a checkpoint holds are on disk before the checkpoint is.
    from unified.metrics import JsonlSink

    write = JsonlSink.write

    def write_until_step_4(sink: JsonlSink, step: int, metrics: Any) -> None:
        if step == 4:
            raise OSError("disk full")
        write(sink, step, metrics)

    monkeypatch.setattr(JsonlSink, "write", write_until_step_4)
    config = make_config(mode="async", trainer={"total_steps": 6, "save_every": 2})
    with pytest.raises(OSError, match="disk full"):
        fit(config, BanditBackend())
    run = RunDirectory(Path(config["logging"]["run_dir"]) / config["name"])
    saved = RunDirectory.load_state(run.latest_checkpoint())
    assert saved.step == 2, "no checkpoint after the step whose metrics were not written"
    steps = [m["step"] for m in metrics_lines(run.path)]
    assert steps[:3] == [1, 2, 3] and 4 not in steps, steps


def test_checkpoint_resume_continues_without_training_a_task_twice(
    make_config: ConfigFactory,
) -> None:
    full = make_config(name="full", trainer={"total_steps": 6, "save_every": 0})
    full_run = fit(full, BanditBackend())
    first = make_config(name="resumed", trainer={"total_steps": 3, "save_every": 3})
    fit(first, BanditBackend())
    second = make_config(name="resumed", resume=True, trainer={"total_steps": 6, "save_every": 3})
    backend = BanditBackend()
    result = fit(second, backend)
    assert result.steps == 6
    assert trained(ledger(result.run_dir)) == trained(ledger(full_run.run_dir))
    steps = [m["step"] for m in metrics_lines(result.run_dir)]
    assert steps == [1, 2, 3, 4, 5, 6], "the step counter continues"


def test_resume_warns_of_groups_in_flight_whose_tasks_left_the_dataset(
    make_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_config(name="shrunk", mode="async", trainer={"total_steps": 3, "save_every": 2})
    run_dir = fit(first, BanditBackend()).run_dir
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")  # resume from the mid-run one
    state = RunDirectory.load_state(run_dir / "checkpoints" / "step_000002")
    assert state.redispatch, "async admission keeps groups in flight at a mid-run checkpoint"
    # Other train tasks are refused (test_cli.py) unless the state predates the tasks'
    # fingerprint: such a state resumes, and the groups it cannot run again are named.
    del state.sampler["order"]
    path = run_dir / "checkpoints" / "step_000002" / "trainer_state.json"
    path.write_text(state.model_dump_json())
    second = {**first, "resume": True, "trainer": {**first["trainer"], "total_steps": 4}}
    with caplog.at_level(logging.WARNING, logger="unified.loop"):
        fit(second, BanditBackend(), train_tasks=bandit_tasks(24, prefix="other"))
    assert f"{len(state.redispatch)} group(s) in flight" in caplog.text
    assert "no longer in data.train" in caplog.text


def test_time_budget_ends_the_run_between_steps_with_a_final_eval(
    make_config: ConfigFactory,
) -> None:
    config = make_config(
        mode="async",
        # No filtering: a converged bandit would otherwise end the run before the budget does.
        trainer={
            "total_steps": 10_000,
            "max_time_s": 0.3,
            "eval_every": 1_000,
            "filter_groups": False,
        },
    )
    backend = BanditBackend(latency=heavy_tailed_latency())
    result = fit(config, backend, eval_tasks=bandit_tasks(3, prefix="e"))
    assert 0 < result.steps < 10_000
    assert "eval/accuracy" in result.metrics, "the last step is evaluated like a final step"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_mid_sync_window_keeps_the_staleness_bound(
    make_config: ConfigFactory, mode: str
) -> None:
    window = {"max_staleness": 0, "sync_every": 2, "strict_staleness": True}
    first = make_config(
        name="mid", mode=mode, trainer={"total_steps": 3, "save_every": 1}, async_=window
    )
    fit(first, BanditBackend(latency=heavy_tailed_latency()))
    second = make_config(
        name="mid",
        mode=mode,
        resume=True,
        trainer={"total_steps": 6, "save_every": 1},
        async_=window,
    )
    result = fit(second, BanditBackend(latency=heavy_tailed_latency()))
    entries = [e for e in ledger(result.run_dir) if e.outcome == "trained"]
    assert len(entries) == 6 * 2
    assert all(e.trainer_version == e.policy_version for e in entries), "s=0 holds across resume"


def test_original_exception_keeps_its_cause(make_config: ConfigFactory) -> None:
    async def wrapped(task: Task, model: RolloutEngine) -> Trajectory:
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise RuntimeError("outer") from e

    with pytest.raises(RuntimeError, match="outer") as info:
        fit(make_config(mode="async"), BanditBackend(), workflow=wrapped)
    assert isinstance(info.value.__cause__, KeyError)


# -- the default async mode: admission by count, nothing thrown away ---------------------------


def test_a_heavy_tailed_run_trains_every_token_it_generates(make_config: ConfigFactory) -> None:
    """Nothing is discarded: every generated token trains, or belongs to the work still in
    flight when the run ends (its tasks go first on resume); lengths trained match generated."""
    config = make_config(
        name="accounting",
        mode="async",
        trainer={"total_steps": 12, "batch_size": 3, "group_size": 3, "filter_groups": False},
        async_={"max_staleness": 1},
    )
    backend = VersionCheckingBandit(latency=heavy_tailed_latency(), capabilities=PARTIAL)
    result = fit(config, backend, workflow=multi_call_workflow(2))
    lines = metrics_lines(result.run_dir)
    total = {k: sum(m[f"tokens/{k}"] for m in lines) for k in ("generated", "trained", "discarded")}
    in_flight = lines[-1].get("tokens/in_flight_at_end", 0.0)
    assert total["discarded"] == 0 and sum(m["episodes/discarded"] for m in lines) == 0
    assert total["generated"] == total["trained"] + in_flight, (total, in_flight)
    assert all(m["groups/requeued"] == 0 for m in lines[:-1]), "none requeued before the end"
    assert lines[-1]["length/trained_over_generated"] == pytest.approx(1.0, abs=0.05)
    assert backend.spanning_requests > 0, "partial rollouts are on by default where supported"
    for m in lines:
        assert 0 <= m["lag/token_mean"] <= m["lag/token_p99"] <= m["lag/token_max"], m


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    staleness=st.integers(0, 2),
    sync_every=st.integers(1, 2),
    batch_size=st.integers(1, 3),
    group_size=st.integers(2, 3),
    seed=st.integers(0, 10_000),
    micro=st.sampled_from([None, 1]),
)
def test_admission_by_count_holds_its_bound_and_every_group_trains_once(
    make_config: ConfigFactory,
    monkeypatch: pytest.MonkeyPatch,
    staleness: int,
    sync_every: int,
    batch_size: int,
    group_size: int,
    seed: int,
    micro: int | None,
) -> None:
    """At every admission the groups admitted and not yet trained (a straggler past its
    deadline: its running share), plus those taken in this window, are fewer than
    (1 + max_staleness) windows; no group is requeued before the run ends; each ends once."""
    from unified.groups import TrajectoryGroupBuffer

    dispatch = TrajectoryGroupBuffer.dispatch
    admitted: list[float] = []

    def checked(self: TrajectoryGroupBuffer) -> Any:
        c = self.coordinator
        admitted.append(self.pending + c.taken)
        assert self.pending + c.taken < c.capacity, (
            f"admitted with {self.pending} pending and {c.taken} taken, capacity {c.capacity}"
        )
        return dispatch(self)

    monkeypatch.setattr(TrajectoryGroupBuffer, "dispatch", checked)
    name = f"count-s{staleness}k{sync_every}b{batch_size}g{group_size}x{seed}m{micro}"
    config = make_config(
        name=f"{name}-{next(_RUN_NUMBERS)}",
        mode="async",
        trainer={
            "total_steps": 5,
            "batch_size": batch_size,
            "group_size": group_size,
            "seed": seed,
            "micro_batch_size": micro,
            "lr": 0.05,
        },
        async_={"max_staleness": staleness, "sync_every": sync_every},
    )
    backend = VersionCheckingBandit(latency=heavy_tailed_latency(), capabilities=PARTIAL)
    result = fit(config, backend, workflow=multi_call_workflow(2))
    entries = ledger(result.run_dir)
    assert admitted, "groups were admitted"
    assert len([e for e in entries if e.outcome == "trained"]) == 5 * batch_size
    early = [e for e in entries if e.outcome == "requeued" and RUN_ENDED not in e.reason]
    assert not early, f"requeued before the end: {early}"
    assert sorted(seqs(entries)) == list(range(len(entries))), "each group ends exactly once"


def test_a_straggler_trains_late_instead_of_being_thrown_away(make_config: ConfigFactory) -> None:
    """The first two groups' workflows hang until version 3: by default they are not requeued
    but train once they finish, later than max_staleness, which the token lag reports."""
    config = make_config(
        name="straggler",
        mode="async",
        trainer={"total_steps": 8, "batch_size": 2, "group_size": 2, "lr": 0.05},
        async_={"max_staleness": 1},
    )
    backend = ThirdSyncBandit()
    stragglers: list[str] = []

    async def workflow(task: Task, model: RolloutEngine) -> Trajectory:
        if len(stragglers) < 2 and task.id not in stragglers:
            stragglers.append(task.id)
        out = await model.chat([{"role": "user", "content": task.id}])
        if task.id in stragglers and not backend.third_sync.is_set():
            async with asyncio.timeout(30):
                await backend.third_sync.wait()
        reward = float(out.text == str(task.data["target"]))
        return Trajectory(steps=[Step(output=out, reward=reward)], reward=reward)

    result = fit(config, backend, workflow=workflow)
    entries = ledger(result.run_dir)
    early = [e for e in entries if e.outcome == "requeued" and RUN_ENDED not in e.reason]
    assert not early, f"nothing is thrown away for being late: {early}"
    first = sorted(entries, key=lambda e: seqs([e])[0])
    ends = {}  # each straggler task's first group
    for e in first:
        ends.setdefault(e.task_id, e)
    ends = {task_id: ends[task_id] for task_id in stragglers}
    assert all(e.outcome in ("trained", "filtered") for e in ends.values()), ends
    late = [e for e in ends.values() if e.outcome == "trained"]
    assert all(e.trainer_version - e.policy_version >= 3 for e in late), late
    if late:
        assert max(m["lag/token_max"] for m in metrics_lines(result.run_dir)) >= 3
