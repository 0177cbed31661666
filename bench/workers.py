"""Rollout workers: episodes/s of a CPU-bound agent with `rollout.workers: 2` against 0.

The workflow calls the model `--turns` times and after each call runs a tool that does
`--tool-ms` of pure-Python work. In the trainer process one event loop (and one GIL) serialises
that work however many episodes are in flight; two Ray workers run it in two processes. The
model is free (bench/overhead.py's zero-latency backend), so the tool work is what is measured,
plus the cost of serving model calls to the workers. Both runs go through the real
`UnifiedTrainer`, in one process, one after the other; Ray starts before either, so its start-up
and the workers' are outside the steady state (first optimizer step to last).

    python -m bench.workers --json runs/bench-workers.json
    python -m bench.workers --remote --json runs/bench-workers-remote.json

`--remote` compares where the workers run instead: on the trainer's own Ray node, or on
another node of a `ray.cluster_utils.Cluster` (every node on 127.0.0.1), which the trainer
joins by address; the figure is the trainer's CPU per episode, remote over local.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.overhead import ZeroBackend, tasks
from bench.overhead import config as overhead_config
from unified import RolloutEngine, Step, Task, Trajectory, UnifiedTrainer


def busy(iterations: int) -> int:
    """Pure-Python work: what a parser, a simulator or a checker does inside a tool call."""
    total = 0
    for i in range(iterations):
        total = (total + i * i) % 1_000_003
    return total


def iterations_for(ms: float) -> int:
    """Iterations of `busy` that take about `ms` milliseconds of CPU on this machine."""
    n = 200_000
    started = time.process_time()  # CPU time: a loaded machine must not shrink the work
    busy(n)
    elapsed = time.process_time() - started
    return max(1, int(n * ms / 1e3 / elapsed))


class ToolAgent:
    """`turns` model calls, each followed by a CPU-bound tool call whose result it reads."""

    def __init__(self, turns: int, iterations: int) -> None:
        self.turns = turns
        self.iterations = iterations

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.data["prompt"]}]
        steps = []
        for _ in range(self.turns):
            out = await model.chat(messages)
            steps.append(Step(messages=messages, output=out))
            result = busy(self.iterations)
            messages = [
                *messages,
                {"role": "assistant", "content": out.text},
                {"role": "tool", "content": str(result)},
            ]
        reward = float(steps[-1].output.completion_ids[0] % 2)
        return Trajectory(steps=steps, reward=reward)


def episodes_per_s(
    args: argparse.Namespace,
    workflow: ToolAgent,
    workers: int,
    resources: dict[str, float] | None = None,
) -> tuple[float, float]:
    """Steady-state episodes per second of one run (first optimizer step to last), and the
    trainer process's CPU milliseconds per episode over the same span; the workers on nodes
    that offer `resources`."""
    with tempfile.TemporaryDirectory() as tmp:
        changes: dict[str, Any] = {"async": {"max_concurrency": 64}}
        rollout: dict[str, Any] = {"workers": workers, "worker_resources": resources or {}}
        config = overhead_config(
            args,
            tmp,
            name=f"workers{workers}",
            workflow="bench.workers:ToolAgent",
            rollout=rollout,
            **changes,
        )
        backend = ZeroBackend()
        UnifiedTrainer(config, workflow=workflow, backend=backend, train_tasks=tasks(4096)).fit()
    (wall0, cpu0), (wall1, cpu1) = backend.step_times[0], backend.step_times[-1]
    episodes = (len(backend.step_times) - 1) * args.groups * args.group_size
    return episodes / (wall1 - wall0), (cpu1 - cpu0) / episodes * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool-ms", type=float, default=40.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--remote", action="store_true", help="local node vs another node")
    args = parser.parse_args()
    if args.remote:
        remote(args)
        return

    import ray

    from unified.ray_runtime import start_local_ray

    start_local_ray(max(args.workers, os.cpu_count() or 1))
    try:
        workflow = ToolAgent(args.turns, iterations_for(args.tool_ms))
        in_process, in_process_cpu_ms = episodes_per_s(args, workflow, 0)
        on_workers, on_workers_cpu_ms = episodes_per_s(args, workflow, args.workers)
    finally:
        ray.shutdown()
    ratio = on_workers / in_process
    figures = {
        "episodes_per_s_in_process": in_process,
        f"episodes_per_s_{args.workers}_workers": on_workers,
        "ratio": ratio,
        "trainer_cpu_ms_per_episode_in_process": in_process_cpu_ms,
        f"trainer_cpu_ms_per_episode_{args.workers}_workers": on_workers_cpu_ms,
        "tool_ms": args.tool_ms,
        "turns": args.turns,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    print(
        f"rollout.workers: 0   {in_process:6.2f} episodes/s   "
        f"trainer CPU {in_process_cpu_ms:6.1f} ms per episode"
    )
    print(
        f"rollout.workers: {args.workers}   {on_workers:6.2f} episodes/s   "
        f"trainer CPU {on_workers_cpu_ms:6.1f} ms per episode   ({ratio:.2f}x)"
    )
    print(f"({args.turns} tool calls of {args.tool_ms:g} ms per episode; load {os.getloadavg()})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def remote(args: argparse.Namespace) -> None:
    """The same workers on the trainer's node, then on another node of a loopback cluster."""
    import ray
    from ray.cluster_utils import Cluster

    from unified.ray_runtime import join_ray

    node = {"num_cpus": args.workers, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "resources": {"here": args.workers}, "include_dashboard": False},
    )
    try:
        cluster.add_node(**node, resources={"there": args.workers})
        cluster.wait_for_nodes()
        join_ray(cluster.address)
        workflow = ToolAgent(args.turns, iterations_for(args.tool_ms))
        local, local_cpu_ms = episodes_per_s(args, workflow, args.workers, {"here": 1})
        far, far_cpu_ms = episodes_per_s(args, workflow, args.workers, {"there": 1})
    finally:
        ray.shutdown()
        cluster.shutdown()
    figures = {
        "episodes_per_s_local_node": local,
        "episodes_per_s_remote_node": far,
        "trainer_cpu_ms_per_episode_local_node": local_cpu_ms,
        "trainer_cpu_ms_per_episode_remote_node": far_cpu_ms,
        "trainer_cpu_ratio": far_cpu_ms / local_cpu_ms,
        "load_average": os.getloadavg(),
    }
    print(
        f"{args.workers} workers on the trainer's node: {local:6.2f} episodes/s, trainer CPU "
        f"{local_cpu_ms:6.1f} ms per episode"
    )
    print(
        f"{args.workers} workers on another node:   {far:6.2f} episodes/s, trainer CPU "
        f"{far_cpu_ms:6.1f} ms per episode ({far_cpu_ms / local_cpu_ms:.2f}x)"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
