"""Orchestration overhead: what the trainer itself costs per trajectory, and per one in flight.

A zero-latency backend (every request returns a 16-token output at once, training is free) and a
zero-latency single-turn workflow run through the real `UnifiedTrainer`, so the wall time is the
trainer's own work: dispatch, the sampling engine's per-request settings, the episode, group
completion, advantages, filtering, the ledger and the metrics. Three figures:

- microseconds per trajectory in steady state (from the first optimizer step to the last, so
  start-up is left out), async loop, `--groups` x `--group-size` rollouts per step; the sync loop
  runs too, and so does the in-process baseline: the same workflow and backend calls awaited one
  after another with no trainer around them (what the trainer adds is the difference);
- bytes per in-flight trajectory: `--in-flight` workflows held open at once (each waits until all
  have started), traced with `tracemalloc`, over a baseline taken just before they start;
- that run with 10,000 workflows in flight completing, with memory flat across its steps.

    python -m bench.overhead --json runs/bench-overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, ClassVar, cast

from unified import (
    BackendProtocol,
    ModelOutput,
    RolloutEngine,
    SamplingParams,
    Step,
    Task,
    Trajectory,
    TrajectoryGroup,
    UnifiedTrainer,
)
from unified.config import LoggingConfig, TrainerConfig
from unified.loop import fewer_young_collections
from unified.protocol import TokenSampler
from unified.records import RecordWriter
from unified.rollout import SamplingEngine

TOKENS = 16


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return [1, 2, 3, 4]


class ZeroSampler:
    """Answers every request at once: `TOKENS` tokens whose parity depends on the seed."""

    def __init__(self, backend: ZeroBackend) -> None:
        self._backend = backend
        self._tokenizer = _Tokenizer()

    @property
    def tokenizer(self) -> _Tokenizer:
        return self._tokenizer

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        token = 2 + (cast(int, params.seed) // 1_000) % 2
        return ModelOutput(
            text="",
            prompt_ids=prompt_ids,
            completion_ids=[token] * TOKENS,
            logprobs=[-0.5] * TOKENS,
            finish_reason="length",
            policy_version=self._backend.version,
        )


class ZeroBackend(BackendProtocol):
    """Free training, instant sampling: the trainer's own cost is all that is left."""

    name: ClassVar[str] = "zero"

    def __init__(self) -> None:
        self.version = 0
        # (wall, process CPU, the event loop thread's CPU) at each optimizer step
        self.step_times: list[tuple[float, float, float]] = []

    async def setup(self, config: TrainerConfig) -> None:
        pass

    def token_sampler(self) -> TokenSampler:
        return ZeroSampler(self)

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        return {"train/loss": 0.0}

    async def optim_step(self) -> dict[str, float]:
        self.step_times.append((time.perf_counter(), time.process_time(), time.thread_time()))
        return {}

    async def on_policy_updated(self, version: int) -> None:
        self.version = version

    async def save_checkpoint(self, directory: Path) -> None:
        pass

    async def load_checkpoint(self, directory: Path) -> None:
        pass

    async def shutdown(self) -> None:
        pass


async def single_turn(task: Task, model: RolloutEngine) -> Trajectory:
    """The cheapest honest workflow: one chat call, a reward read off the output."""
    messages = [{"role": "user", "content": task.data["prompt"]}]
    out = await model.chat(messages)
    reward = float(out.completion_ids[0] % 2)
    return Trajectory(steps=[Step(messages=messages, output=out, reward=reward)], reward=reward)


class Barrier:
    """Holds every workflow until `size` have started: that many are in flight at once.

    Each time it fills, it notes the traced memory over what was traced (after a collection)
    when its first workflow of that round started.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.started = 0
        self.open = asyncio.Event()
        self.peak_bytes = 0
        self._baseline = 0

    async def workflow(self, task: Task, model: RolloutEngine) -> Trajectory:
        self.started += 1
        if self.started % self.size == 1:
            self.open.clear()
            gc.collect()
            self._baseline = tracemalloc.get_traced_memory()[0]
        elif self.started % self.size == 0:
            used = tracemalloc.get_traced_memory()[0] - self._baseline
            self.peak_bytes = max(self.peak_bytes, used)
            self.open.set()
        await self.open.wait()
        return await single_turn(task, model)


def config(args: argparse.Namespace, run_dir: str, **changes: Any) -> dict[str, Any]:
    trainer = {
        "total_steps": args.steps,
        "batch_size": args.groups,
        "group_size": args.group_size,
        "eval_every": 0,
        "eval_before_train": False,
        "save_every": 0,
        "max_filtered_in_a_row": 1_000_000,
    }
    base: dict[str, Any] = {
        "name": "overhead",
        "mode": "async",
        "workflow": "bench.overhead:single_turn",
        "trainer": trainer,
        "async": {"max_staleness": 1, "max_concurrency": args.groups * args.group_size * 2},
        "sampling": {"train": {"max_tokens": TOKENS}},
        "logging": {"run_dir": run_dir, "console": False},
    }
    for key, value in changes.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", data={"prompt": f"question {i}"}) for i in range(n)]


def per_trajectory(
    args: argparse.Namespace, mode: str, records: bool = True
) -> tuple[float, float]:
    """Steady-state (wall, CPU) microseconds per trajectory of one run (best of `--repeats`)."""
    best = (float("inf"), float("inf"))
    for _ in range(args.repeats):
        wall, cpu, _loop = one_run(args, mode, records)
        best = min(best, (wall, cpu))
    return best


def one_run(args: argparse.Namespace, mode: str, records: bool) -> tuple[float, float, float]:
    """Steady-state microseconds per trajectory of one run: wall, process CPU, and the CPU of
    the event loop's thread alone (its own work, without the waits for the GIL or the host)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = config(args, tmp, mode=mode, name=mode, logging={"records": records})
        backend = ZeroBackend()
        UnifiedTrainer(run, backend=backend, train_tasks=tasks(4096)).fit()
    first, last = backend.step_times[0], backend.step_times[-1]
    n = (len(backend.step_times) - 1) * args.groups * args.group_size
    wall, cpu, loop = ((b - a) / n * 1e6 for a, b in zip(first, last, strict=True))
    return wall, cpu, loop


def writer_cpu_us(args: argparse.Namespace) -> tuple[float, float]:
    """CPU microseconds per trajectory that the records' writer thread spent in one async run,
    in all and outside the compression (which releases the GIL): the rest holds the GIL, so
    the event loop cannot run while it does."""
    spent, compressing = [0.0], [0.0]
    write = RecordWriter._write
    compress = gzip.compress

    def timed_compress(data: bytes, *args: Any, **kwargs: Any) -> bytes:
        started = time.thread_time()
        try:
            return compress(data, *args, **kwargs)
        finally:
            compressing[0] += time.thread_time() - started

    def timed(self: RecordWriter, records: list[Any]) -> None:
        started = time.thread_time()
        write(self, records)
        spent[0] += time.thread_time() - started

    submit = RecordWriter._submit

    def timed_submit(self: RecordWriter, build: Any) -> None:
        def built() -> Any:
            started = time.thread_time()
            try:
                return build()
            finally:
                spent[0] += time.thread_time() - started

        submit(self, built)

    RecordWriter._write, RecordWriter._submit = timed, timed_submit  # type: ignore[method-assign]
    gzip.compress = timed_compress
    try:
        per_trajectory(argparse.Namespace(**{**vars(args), "repeats": 1}), "async")
    finally:
        RecordWriter._write, RecordWriter._submit = write, submit  # type: ignore[method-assign]
        gzip.compress = compress
    per_us = 1e6 / (args.steps * args.groups * args.group_size)
    return spent[0] * per_us, (spent[0] - compressing[0]) * per_us


def records_cost(args: argparse.Namespace) -> dict[str, float]:
    """What the rollout records cost the trainer, two ways, from `--records-runs` runs each
    without, with and without again, interleaved in turns, compared by lower quartiles (on a
    shared VM the slow runs are other tenants' work, which only ever adds; the fast end of each
    series is the trainer's own), the two series without pooled:

    - `wall`: step time with over without; `wall_noise`: the two series without compared (the
      host's noise floor, which this ratio cannot see under);
    - `loop`: the event loop thread's own CPU with over without (what recording adds to the
      loop's work, blind to host noise and to the waits for the GIL, which `writer_cpu_us`
      measures); `loop_noise`: its two series without compared.
    """
    one = argparse.Namespace(**{**vars(args), "repeats": 1})
    kinds = ["without", "with", "without, again"]
    walls: dict[str, list[float]] = {kind: [] for kind in kinds}
    loops: dict[str, list[float]] = {kind: [] for kind in kinds}
    for turn in range(args.records_runs):
        for kind in kinds[turn % 3 :] + kinds[: turn % 3]:
            wall, _, loop = one_run(one, "async", records=kind == "with")
            walls[kind].append(wall)
            loops[kind].append(loop)

    def low(times: list[float]) -> float:
        return statistics.quantiles(times, n=4)[0]

    def ratios(series: dict[str, list[float]]) -> tuple[float, float]:
        without = low(series["without"] + series["without, again"])
        return low(series["with"]) / without, low(series["without, again"]) / low(series["without"])

    (wall, wall_noise), (loop, loop_noise) = ratios(walls), ratios(loops)
    return {"wall": wall, "wall_noise": wall_noise, "loop": loop, "loop_noise": loop_noise}


def direct(args: argparse.Namespace) -> tuple[float, float]:
    """(Wall, CPU) microseconds per call of the workflow and backend alone, one after another."""

    async def calls(n: int) -> tuple[float, float]:
        sampler, work = ZeroBackend().token_sampler(), tasks(1024)
        defaults = SamplingParams(max_tokens=TOKENS)
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(n):
            await single_turn(work[i % 1024], SamplingEngine(sampler, defaults, seed=i))
        return (time.perf_counter() - wall) / n * 1e6, (time.process_time() - cpu) / n * 1e6

    n = (args.steps - 1) * args.groups * args.group_size
    with fewer_young_collections():  # as the trainer runs
        return min(asyncio.run(calls(n)) for _ in range(args.repeats))


def as_tasks(args: argparse.Namespace) -> tuple[float, float]:
    """(Wall, CPU) microseconds per call of the same calls, each its own asyncio task in a task
    group, a step's worth at a time: the floor of any trainer that runs rollouts as tasks."""

    async def calls(n: int) -> tuple[float, float]:
        sampler, work = ZeroBackend().token_sampler(), tasks(1024)
        defaults = SamplingParams(max_tokens=TOKENS)
        per_step = args.groups * args.group_size
        wall, cpu = time.perf_counter(), time.process_time()
        for start in range(0, n, per_step):
            async with asyncio.TaskGroup() as group:
                for i in range(start, min(n, start + per_step)):
                    engine_i = SamplingEngine(sampler, defaults, seed=i)
                    group.create_task(single_turn(work[i % 1024], engine_i))
        return (time.perf_counter() - wall) / n * 1e6, (time.process_time() - cpu) / n * 1e6

    n = (args.steps - 1) * args.groups * args.group_size
    with fewer_young_collections():  # as the trainer runs
        return min(asyncio.run(calls(n)) for _ in range(args.repeats))


def in_flight(args: argparse.Namespace) -> dict[str, float]:
    """Bytes per in-flight trajectory with `--in-flight` workflows open at once; memory drift."""
    groups = args.in_flight // args.group_size
    barrier = Barrier(groups * args.group_size)
    step_bytes: list[int] = []

    class Measured(ZeroBackend):
        async def optim_step(self) -> dict[str, float]:
            gc.collect()
            step_bytes.append(tracemalloc.get_traced_memory()[0])
            return {}

    with tempfile.TemporaryDirectory() as tmp:
        run = config(
            args,
            tmp,
            trainer={"batch_size": groups, "total_steps": args.in_flight_steps},
            **{"async": {"max_staleness": 0, "max_concurrency": groups * args.group_size}},
        )
        trainer = UnifiedTrainer(
            run, workflow=barrier.workflow, backend=Measured(), train_tasks=tasks(4096)
        )
        tracemalloc.start()
        try:
            trainer.fit()
        finally:
            tracemalloc.stop()
    n = groups * args.group_size
    drift = (step_bytes[-1] - step_bytes[1]) / max(1, len(step_bytes) - 2)
    return {
        "bytes_per_in_flight_trajectory": barrier.peak_bytes / n,
        "max_in_flight": float(n),
        "bytes_drift_per_step": drift,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=64, help="groups per step")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (best is kept)")
    parser.add_argument("--in-flight", type=int, default=10_000)
    parser.add_argument("--in-flight-steps", type=int, default=4)
    parser.add_argument(
        "--records-runs", type=int, default=16, help="runs each without and with records"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.records_runs < 2:
        parser.error("--records-runs: at least 2 (a lower quartile needs two runs)")
    (us_async, cpu_async), (us_sync, _) = (
        per_trajectory(args, "async"),
        per_trajectory(args, "sync"),
    )
    records = records_cost(args)
    writer = [writer_cpu_us(args) for _ in range(3)]
    records_cpu = statistics.median(total for total, _ in writer)
    records_gil = statistics.median(held for _, held in writer)
    us_direct, cpu_direct = direct(args)
    us_tasks, cpu_tasks = as_tasks(args)
    memory = in_flight(args)
    print(
        f"{args.groups} groups x {args.group_size} rollouts per step, {args.steps} steps, "
        "steady state:"
    )
    print(f"  async trainer: {us_async:.1f} us per trajectory ({cpu_async:.1f} us of CPU)")
    print(f"  sync trainer:  {us_sync:.1f} us per trajectory")
    records_cost_share = records["loop"] - 1 + records_gil / us_async
    print(
        f"  rollout records (defaults: one group in {LoggingConfig().record_every}, the "
        f"timeline), {args.records_runs} runs with them and twice as many without (lower "
        f"quartiles): {records_cost_share:+.1%} of the trainer's time: the event loop's own CPU "
        f"{records['loop'] - 1:+.1%} (its two series without differ by "
        f"{records['loop_noise'] - 1:+.1%}), and their writer thread holding the GIL "
        f"{records_gil / us_async:.1%} ({records_gil:.2f} us per trajectory of its "
        f"{records_cpu:.2f} us of CPU); step time {records['wall'] - 1:+.1%} (the two series "
        f"without differ by {records['wall_noise'] - 1:+.1%}: this host's noise floor)"
    )
    print(
        f"  workflow + backend alone, no trainer: {us_direct:.1f} us per call "
        f"({cpu_direct:.1f} us of CPU)"
    )
    print(
        f"  the same calls, each an asyncio task: {us_tasks:.1f} us per call "
        f"({cpu_tasks:.1f} us of CPU): the floor of a trainer with a task per rollout"
    )
    print(
        f"  the async trainer adds {us_async - us_direct:.1f} us per trajectory "
        f"({cpu_async - cpu_direct:.1f} us of CPU; {cpu_async / cpu_direct:.2f}x the bare calls)"
    )
    print(
        f"{memory['max_in_flight']:.0f} workflows in flight at once: "
        f"{memory['bytes_per_in_flight_trajectory']:.0f} bytes each; "
        f"memory drift {memory['bytes_drift_per_step']:+.0f} bytes per step"
    )
    report = {
        "us_per_trajectory": us_async,
        "bytes_per_in_flight_trajectory": memory["bytes_per_in_flight_trajectory"],
        "max_in_flight": int(memory["max_in_flight"]),
        "cpu_us_per_trajectory": cpu_async,
        "us_per_trajectory_sync": us_sync,
        "records_cost_share": records_cost_share,
        "records_loop_cpu_ratio": records["loop"],
        "records_loop_cpu_noise_ratio": records["loop_noise"],
        "records_step_time_ratio": records["wall"],
        "records_noise_ratio": records["wall_noise"],
        "records_writer_cpu_us_per_trajectory": records_cpu,
        "records_writer_gil_us_per_trajectory": records_gil,
        "us_per_call_without_trainer": us_direct,
        "cpu_us_per_call_without_trainer": cpu_direct,
        "us_per_call_as_tasks": us_tasks,
        "bytes_drift_per_step": memory["bytes_drift_per_step"],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
