"""Pipeline efficiency: sync vs async on three workloads, each against its ideal bound.

Every workload runs the real trainer on the bandit test backend with simulated costs: latency as
asyncio sleeps (a remote sampler, a tool), training as a blocking sleep in a worker thread (an
accelerator busy elsewhere). Each mode's ideal time per step is its schedule replayed with zero
overhead on the very latencies the run drew (`ideal_step_s`): the same seeded draws in dispatch
order, `max_concurrency` FIFO slots, admission and the choice of the group to train by the
trainer's own `SyncCoordinator`, training the time the run measured. What the run takes beyond
the replay is the implementation's own cost. A closed-form bound that ignores the staleness
deadlines (`simple_bound_s`) is printed beside it: the gap between the two is what a hard
per-group `max_staleness` costs on that workload, not overhead.

Efficiency is ideal / measured time per step (steady state: first optimizer step to last).
Async mode is also measured against the physical bound, max(training time, generation time) per
step (generation time: the batch's rollout work over the concurrency limit), and against the
strict per-group bound without over-admission (`async.strict_staleness: true, over_admit: 0`,
also the replayed schedule) in the same process; `--over-admit X` runs the async mode under the
strict rule with that allowance. The workloads: (a)
heavy-tailed time inside the workflow (tools, environments); (b) generation bound: a long tail
inside the model request and a concurrency limit; (c) training bound; (d-f) training bound with
heavy-tailed workflows at `max_staleness: 1`, the slowest episodes lasting several steps, at two
tails and two batch shapes.

With `--sampler` it runs the workloads whose latency sits in the sampler instead
(`bench.engine_sim`: token by token, bounded engine slots, a version per token), in three
async modes in the same process: the default (admission by count, partial rollouts), the same
with requests finishing on their snapshot (the tinker backend's case), and the strict per-group
bound with over-admission (the default before 2026-12). Each row: efficiency against the
physical bound max(training, generation), tokens decoded per token trained, mean trained
length over the mean length of every request made, the trained tokens' lag (mean, p99, max),
the engine's idle share.

    python -m bench.pipeline --json runs/bench-pipeline.json
    python -m bench.pipeline --sampler --steps 60 --json runs/bench-pipeline-sampler.json
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.engine_sim import EngineBackend, EngineWorkload, engine_workloads
from unified import RolloutEngine, Step, Task, Trajectory, TrajectoryGroup, UnifiedTrainer
from unified.config import TrainerConfig
from unified.coordinator import SyncCoordinator
from unified.testing import BanditBackend, bandit_tasks


@dataclass(frozen=True)
class Workload:
    """Costs of one simulated workload; latencies are lognormal (median, sigma) in seconds."""

    name: str
    batch: int  # groups per step
    group: int  # rollouts per group
    train_s: float  # training time per step
    workflow_median_s: float = 0.0  # time in the workflow, outside the model
    model_median_s: float = 0.0  # time inside the model request
    sigma: float = 1.0
    max_concurrency: int = 1024
    max_staleness: int = 2
    sync_every: int = 1
    micro_batch: int | None = 1  # stream: train each group as soon as it is ready

    def latency(self, rng: random.Random, median_s: float) -> float:
        return median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if median_s else 0.0


WORKLOADS = (
    Workload("workflow_heavy_tail", batch=8, group=8, train_s=0.10, workflow_median_s=0.02),
    Workload(
        "generation_bound",
        batch=8,
        group=8,
        train_s=0.02,
        model_median_s=0.02,
        max_concurrency=16,
        # Groups waiting on one straggler hold admission slots: more in flight keeps 16 busy.
        max_staleness=4,
    ),
    Workload("training_bound", batch=8, group=8, train_s=0.20, model_median_s=0.005),
    Workload(
        "tail_training_bound",
        batch=8,
        group=8,
        train_s=0.10,
        workflow_median_s=0.02,
        max_staleness=1,
    ),
    Workload(
        "heavier_tail_training_bound",
        batch=8,
        group=8,
        train_s=0.10,
        workflow_median_s=0.02,
        sigma=1.5,
        max_staleness=1,
    ),
    Workload(
        "tail_training_bound_wide",
        batch=16,
        group=4,
        train_s=0.10,
        workflow_median_s=0.02,
        max_staleness=1,
    ),
)


def ideal_step_s(w: Workload, mode: str, train_s: float, args: argparse.Namespace) -> float:
    """The ideal time per step of `mode` on the very latencies the run drew: its schedule
    replayed with zero overhead.

    The replay draws the run's latencies from the same seeded generators in the same order
    (dispatch order: each workload has one latency source), runs rollouts on
    `max_concurrency` FIFO slots, admits groups with the trainer's own `SyncCoordinator`, and
    has the trainer take the oldest ready group that `may_take` allows, training it for
    `train_s / batch` (streamed) or the batch for `train_s`. What the measured run takes beyond
    this is the implementation's own overhead. `train_s` is the training time per step the run
    measured (`time/train`): the simulated accelerator is a sleeping thread, which a busy host
    wakes late, and that is not the pipeline's doing.
    """
    seed, steps = args.seed, args.steps
    rng = random.Random(seed + 1 if w.workflow_median_s else seed)
    config = TrainerConfig.model_validate(run_config(w, mode, args, "unused", over_admit=0.0))
    coordinator = SyncCoordinator.for_config(config)
    slots = [0.0] * min(w.max_concurrency, w.batch * w.group * (w.max_staleness + 2))
    pending: list[tuple[int, int, float]] = []  # (version, seq, ready time)
    seqs = itertools.count()
    streamed = mode == "async" and w.micro_batch is not None
    now = 0.0

    def admit(done: int) -> None:
        coordinator.wanted = (steps - done) * w.batch
        while coordinator.can_admit():
            version, ready = coordinator.admit(), 0.0
            for _ in range(w.group):
                start = max(now, heapq.heappop(slots))
                end = start + w.latency(rng, w.workflow_median_s) + w.latency(rng, w.model_median_s)
                heapq.heappush(slots, end)
                ready = max(ready, end)
            pending.append((version, next(seqs), ready))

    ends: list[float] = []
    admit(0)
    for step in range(1, steps + 1):
        for _ in range(w.batch):
            # The oldest ready group, if the staleness arithmetic lets it train; else wait.
            while not (ready := [g for g in pending if g[2] <= now]) or not (
                coordinator.may_take(min(ready)[0])
            ):
                now = min(g[2] for g in pending if g[2] > now)
            group = min(ready)
            pending.remove(group)
            coordinator.take(group[0])
            now += train_s / w.batch if streamed else 0.0
        now += 0.0 if streamed else train_s
        if step % coordinator.steps_per_window == 0:
            coordinator.open_window(coordinator.version + 1)
            admit(step)
        ends.append(now)
    return (ends[-1] - ends[0]) / (steps - 1)


def simple_bound_s(w: Workload, mode: str, train_s: float, samples: int = 20_000) -> float:
    """A closed-form bound by Monte Carlo, for reference: it ignores the staleness deadlines.

    sync: E[slowest rollout of the batch] (or the batch's work over the concurrency limit) +
    training; async: the largest of training, the batch's work over the concurrency limit and
    `E[slowest rollout of a group] / (max_staleness * sync_every)`.
    """
    rng = random.Random(12345)

    def rollout() -> float:
        return w.latency(rng, w.workflow_median_s) + w.latency(rng, w.model_median_s)

    def expected_max(n: int) -> float:
        return statistics.fmean(max(rollout() for _ in range(n)) for _ in range(samples // n))

    mean = statistics.fmean(rollout() for _ in range(samples))
    spread = w.batch * w.group * mean / w.max_concurrency
    if mode == "sync":
        return max(expected_max(w.batch * w.group), spread) + train_s
    admission = expected_max(w.group) / (w.max_staleness * w.sync_every)
    return max(train_s, spread, admission)


def physical_bound_s(w: Workload, train_s: float, samples: int = 20_000) -> float:
    """max(training time, generation time) per step: no schedule can beat it."""
    rng = random.Random(12345)
    mean = statistics.fmean(
        w.latency(rng, w.workflow_median_s) + w.latency(rng, w.model_median_s)
        for _ in range(samples)
    )
    return max(train_s, w.batch * w.group * mean / w.max_concurrency)


class SimulatedBackend(BanditBackend):
    """The bandit with a sleep inside each model request and a blocking cost per step."""

    def __init__(self, w: Workload, seed: int) -> None:
        super().__init__(latency=self._request_latency)
        self.w = w
        self.rng = random.Random(seed)
        self.step_times: list[float] = []

    async def _request_latency(self, seed: int) -> None:
        await asyncio.sleep(self.w.latency(self.rng, self.w.model_median_s))

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        await asyncio.to_thread(time.sleep, self.w.train_s * len(groups) / self.w.batch)
        return await super().forward_backward(groups)

    async def optim_step(self) -> dict[str, float]:
        self.step_times.append(time.perf_counter())
        return await super().optim_step()


def tool_workflow(w: Workload, rng: random.Random) -> Any:
    """A bandit episode that spends a lognormal time outside the model first (a tool call)."""

    async def run(task: Task, model: RolloutEngine) -> Trajectory:
        await asyncio.sleep(w.latency(rng, w.workflow_median_s))
        messages = [{"role": "user", "content": f"pick {task.data['target']}"}]
        out = await model.chat(messages)
        reward = float(out.text == str(task.data["target"]))
        return Trajectory(steps=[Step(messages=messages, output=out, reward=reward)], reward=reward)

    return run


def trainer_section(
    args: argparse.Namespace, batch: int, group: int, micro_batch: int | None
) -> dict[str, Any]:
    """A bench run's `trainer:`: no evaluation, no checkpoints, no filtering."""
    return {
        "total_steps": args.steps,
        "batch_size": batch,
        "group_size": group,
        "lr": 0.01,
        "eval_every": 0,
        "eval_before_train": False,
        "save_every": 0,
        "filter_groups": False,  # every group trains: no refills blur the bound
        "seed": args.seed,
        "micro_batch_size": micro_batch,
    }


def run_config(
    w: Workload, mode: str, args: argparse.Namespace, run_dir: str, over_admit: float | None = None
) -> dict[str, Any]:
    """The run's config: the workload's batch, staleness and concurrency, no filtering."""
    return {
        "name": f"{w.name}-{mode}-over{over_admit}",
        "mode": mode,
        "workflow": "unified.testing:BanditWorkflow",
        "trainer": trainer_section(args, w.batch, w.group, w.micro_batch),
        "async": {
            "max_staleness": w.max_staleness,
            "sync_every": w.sync_every,
            "max_concurrency": w.max_concurrency,
            # An over-admission allowance is the strict rule's (the default requeues nothing).
            **({} if over_admit is None else {"strict_staleness": True, "over_admit": over_admit}),
        },
        "logging": {"run_dir": run_dir, "console": False},
    }


def measure(
    w: Workload, mode: str, args: argparse.Namespace, run_dir: str, over_admit: float | None = None
) -> dict[str, float]:
    backend = SimulatedBackend(w, args.seed)
    config = run_config(w, mode, args, run_dir, over_admit)
    workflow = tool_workflow(w, random.Random(args.seed + 1))
    trainer = UnifiedTrainer(
        config, workflow=workflow, backend=backend, train_tasks=bandit_tasks(256, target=1)
    )
    result = trainer.fit()
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = lines[1:]
    times = backend.step_times
    return {
        "step_s": (times[-1] - times[0]) / (len(times) - 1),
        "trainer_idle_ratio": statistics.fmean(m["trainer/idle_ratio"] for m in steady),
        "rollout_idle_ratio": statistics.fmean(m["rollout/idle_ratio"] for m in steady),
        "sync_s": statistics.fmean(m["time/sync"] for m in steady),
        "train_s": statistics.fmean(m["time/train"] for m in steady),
        # Generation thrown away by requeued groups: a share of all episodes finished.
        "discarded": sum(m["episodes/discarded"] for m in lines)
        / max(1.0, sum(m["groups/trained"] for m in lines) * w.group),
        "requeued": sum(m["groups/requeued"] for m in lines),
    }


ENGINE_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "snapshot": {"partial_rollout": False},
    "strict": {"strict_staleness": True, "partial_rollout": False},
}
"""The async modes `--sampler` compares: `async:` keys over the workload's own."""


def measure_engine(w: EngineWorkload, mode: str, args: argparse.Namespace, run_dir: str) -> dict:
    """One async run of `w` in `mode` (`ENGINE_MODES`); the engine's own books."""
    backend = EngineBackend(w)
    config = {
        "name": f"{w.name}-{mode}",
        "mode": "async",
        "workflow": "unified.testing:BanditWorkflow",
        "trainer": trainer_section(args, w.batch, w.group, micro_batch=1),
        "async": {"max_staleness": w.max_staleness, "max_concurrency": 4 * w.slots}
        | ENGINE_MODES[mode],
        "sampling": {"train": {"max_tokens": w.max_tokens}},
        "logging": {"run_dir": run_dir, "console": False},
    }
    started = time.monotonic()
    trainer = UnifiedTrainer(config, backend=backend, train_tasks=bandit_tasks(512, target=1))
    result = trainer.fit()
    wall_s = time.monotonic() - started
    times = backend.step_times
    step_s = (times[-1] - times[0]) / (len(times) - 1)
    trained = sum(backend.trained_lengths)
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    bound_s = max(statistics.fmean(m["time/train"] for m in lines[1:]), w.generation_s())
    return {
        "of_physical_bound": bound_s / step_s,
        "step_s": step_s,
        "bound_s": bound_s,
        "decoded_per_trained": backend.decoded / trained,
        "trained_over_generated_length": statistics.fmean(backend.trained_lengths)
        / statistics.fmean(backend.requested_lengths),
        "lag_mean": sum(k * n for k, n in backend.trained_lags.items()) / trained,
        "lag_p99": backend.lag(0.99),
        "lag_max": float(max(backend.trained_lags)),
        "engine_idle": max(0.0, 1.0 - backend.busy_s / (w.slots * wall_s)),
        "requeued": sum(m["groups/requeued"] for m in lines),
    }


def main_sampler(args: argparse.Namespace) -> None:
    """The sampler-latency workloads, each in every `ENGINE_MODES` mode."""
    staleness = (args.staleness,) if args.staleness is not None else (1, 2)
    workloads = [w for w in engine_workloads(staleness) if args.only is None or w.name in args.only]
    report: dict[str, Any] = {}
    print(
        "workload | mode | of bound | decoded/trained | trained/generated length | "
        "token lag mean/p99/max | engine idle | requeued"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for w in workloads:
            for mode in ENGINE_MODES:
                r = measure_engine(w, mode, args, tmp)
                report[f"{w.name}/{mode}"] = r
                print(
                    f"{w.name} | {mode} | {r['of_physical_bound']:.2f} | "
                    f"{r['decoded_per_trained']:.2f} | {r['trained_over_generated_length']:.2f} | "
                    f"{r['lag_mean']:.2f}/{r['lag_p99']:.0f}/{r['lag_max']:.0f} | "
                    f"{r['engine_idle']:.0%} | {r['requeued']:.0f}",
                    flush=True,
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {w.name: asdict(w) for w in workloads}
        args.json.write_text(json.dumps({**report, "workloads": settings}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, help="max_staleness for every workload")
    parser.add_argument("--no-stream", action="store_true", help="train whole batches only")
    parser.add_argument("--over-admit", type=float, help="async.over_admit (default: config's)")
    parser.add_argument("--only", nargs="+", help="run these workloads only (by name)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--sampler", action="store_true", help="the workloads whose latency sits in the sampler"
    )
    args = parser.parse_args()
    if args.sampler:
        main_sampler(args)
        return
    workloads = [
        replace(
            w,
            max_staleness=w.max_staleness if args.staleness is None else args.staleness,
            micro_batch=None if args.no_stream else w.micro_batch,
        )
        for w in WORKLOADS
        if args.only is None or w.name in args.only
    ]
    report: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in workloads:
            got = {m: measure(w, m, args, tmp, args.over_admit) for m in ("sync", "async")}
            plain = measure(w, "async", args, tmp, over_admit=0.0)
            ideal = {m: ideal_step_s(w, m, got[m]["train_s"], args) for m in ("sync", "async")}
            simple = {m: simple_bound_s(w, m, got[m]["train_s"]) for m in ("sync", "async")}
            bound = physical_bound_s(w, got["async"]["train_s"])
            report[w.name] = {
                "async_over_physical_bound": bound / got["async"]["step_s"],
                "ideal_async_over_sync_physical": got["sync"]["step_s"] / bound,
                "async_over_async_without_over_admit": plain["step_s"] / got["async"]["step_s"],
                "async_without_over_admit_over_physical_bound": bound / plain["step_s"],
                "discarded_episodes_share": got["async"]["discarded"],
                "requeued_groups": got["async"]["requeued"],
                "ideal_async_over_sync": ideal["sync"] / ideal["async"],
                "async_efficiency": ideal["async"] / got["async"]["step_s"],
                "sync_efficiency": ideal["sync"] / got["sync"]["step_s"],
                "async_over_sync": got["sync"]["step_s"] / got["async"]["step_s"],
                "trainer_idle_ratio": got["async"]["trainer_idle_ratio"],
                "rollout_idle_ratio": got["async"]["rollout_idle_ratio"],
                "async_efficiency_closed_form": simple["async"] / got["async"]["step_s"],
            }
            r = report[w.name]
            print(
                f"{w.name}: step sync {got['sync']['step_s'] * 1e3:.0f} ms "
                f"(ideal {ideal['sync'] * 1e3:.0f}), async {got['async']['step_s'] * 1e3:.0f} ms "
                f"(ideal {ideal['async'] * 1e3:.0f}); async training "
                f"{got['async']['train_s'] * 1e3:.0f} ms of a nominal {w.train_s * 1e3:.0f}, "
                f"time/sync {got['async']['sync_s'] * 1e3:.1f} ms"
            )
            print(
                f"  efficiency async {r['async_efficiency']:.2f}, sync {r['sync_efficiency']:.2f}; "
                f"async/sync {r['async_over_sync']:.2f}x of an ideal "
                f"{r['ideal_async_over_sync']:.2f}x "
                f"({r['async_over_sync'] / r['ideal_async_over_sync']:.2f}); idle: trainer "
                f"{r['trainer_idle_ratio']:.0%}, rollout {r['rollout_idle_ratio']:.0%}"
            )
            print(
                f"  physical bound max(train, generation) {bound * 1e3:.0f} ms: async "
                f"{r['async_over_physical_bound']:.2f} of it ({r['requeued_groups']:.0f} groups "
                f"requeued, {r['discarded_episodes_share']:.1%} of the episodes thrown away); "
                f"async/sync {r['async_over_sync']:.2f}x of a physical "
                f"{r['ideal_async_over_sync_physical']:.2f}x "
                f"({r['async_over_sync'] / r['ideal_async_over_sync_physical']:.2f}); "
                f"strict without over-admission "
                f"{r['async_without_over_admit_over_physical_bound']:.2f} "
                f"of the bound ({r['async_over_async_without_over_admit']:.2f}x slower)"
            )
            print(
                f"  closed-form bound (no staleness deadlines): sync {simple['sync'] * 1e3:.0f} "
                f"ms, async {simple['async'] * 1e3:.0f} ms (async efficiency against it "
                f"{r['async_efficiency_closed_form']:.2f})"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {w.name: asdict(w) for w in workloads}
        args.json.write_text(json.dumps({**report, "workloads": settings}, indent=2))


if __name__ == "__main__":
    main()
