"""The local backend's training pass on tool-agent episodes: one row per trajectory vs per turn.

Each turn of a multi-turn episode is a model call whose prompt holds the whole conversation so
far. Scored one call at a time, a three-turn episode's first prompt goes through the model three
times; scored as one row (the trajectory's last prompt and completion, with every call's
completion picked out of it) it goes through once. This samples `--episodes` countdown tool-agent
episodes from the tool warm start at the train settings, then times `forward_backward` (policy
and reference passes, backward) on the same batch both ways, in alternating rounds in one
process, and prints the medians and their ratio. The losses agree (tests/test_workflows_masking.py
checks the gradients too).

    python -m bench.multiturn_scoring --json runs/bench-multiturn-scoring.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from unittest import mock

from backends.local.backend import LocalBackend
from examples.countdown.prepare import TOOL_WARMSTART_DIR, TOOL_WARMSTART_RECIPE, ensure_warmstart
from examples.countdown.tasks import make_tasks
from unified.advantages import compute_advantages
from unified.config import load_config
from unified.rollout import SamplingEngine, WorkflowDeadlines, resolve_workflow, run_episode
from unified.types import Episode, ModelOutput, Trajectory, TrajectoryGroup

CONFIG = "examples/countdown/local_tool_async.yaml"


async def sample_groups(
    backend: LocalBackend, episodes: int, group_size: int
) -> list[TrajectoryGroup]:
    """`episodes` tool-agent episodes at the train settings, as GRPO groups of `group_size`."""
    config = backend.config
    sampler, workflow = backend.token_sampler(), resolve_workflow(config.workflow)
    defaults = config.sampling.train
    deadlines = WorkflowDeadlines(config.trainer.workflow_timeout_s)
    tasks = make_tasks(episodes // group_size, split="train", seed=0)

    async def one(index: int) -> Episode:
        view = SamplingEngine(sampler, defaults, index)
        task = tasks[index // group_size]
        episode, _ = await run_episode(
            workflow, task, view,
            rollout_index=index % group_size, version=0, deadlines=deadlines,
        )  # fmt: skip
        return episode

    async with asyncio.TaskGroup() as group:
        running = [group.create_task(one(i)) for i in range(len(tasks) * group_size)]
    done = [task.result() for task in running]
    groups = []
    for start in range(0, len(done), group_size):
        members = done[start : start + group_size]
        rewards = [e.reward for e in members]
        groups.append(
            TrajectoryGroup(
                task_id=members[0].task_id,
                episodes=members,
                advantages=compute_advantages(config.trainer.advantage, rewards),
                policy_version=0,
            )
        )
    return groups


def one_call_per_run(trajectory: Trajectory) -> list[list[ModelOutput]]:
    """Each model call scored on its own, as before one-pass scoring."""
    return [[step.output] for step in trajectory.steps if step.output.completion_ids]


def time_pass(backend: LocalBackend, groups: list[TrajectoryGroup]) -> float:
    start = time.perf_counter()
    backend._forward_backward(groups)
    elapsed = time.perf_counter() - start
    backend.optimizer.zero_grad(set_to_none=True)
    backend._grad_norm_denominator = 0.0
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64, help="one training step's batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = ensure_warmstart(TOOL_WARMSTART_DIR, TOOL_WARMSTART_RECIPE)
    config = load_config(CONFIG, [f"model={model}"])
    backend = LocalBackend()

    async def prepare() -> list[TrajectoryGroup]:
        await backend.setup(config)
        return await sample_groups(backend, args.episodes, config.trainer.group_size)

    groups = asyncio.run(prepare())
    outputs = [
        s.output for g in groups for e in g.episodes for t in e.trajectories for s in t.steps
    ]
    calls = [o for o in outputs if o.completion_ids]
    times: dict[str, list[float]] = {"one row per trajectory": [], "one row per turn": []}
    time_pass(backend, groups)  # warm-up
    for _ in range(args.rounds):
        times["one row per trajectory"].append(time_pass(backend, groups))
        with mock.patch.object(Trajectory, "sequences", one_call_per_run):
            times["one row per turn"].append(time_pass(backend, groups))
    asyncio.run(backend.shutdown())
    medians = {k: statistics.median(v) for k, v in times.items()}
    per_turn = sum(len(o.prompt_ids) + len(o.completion_ids) for o in calls)
    runs = [
        run for g in groups for e in g.episodes for t in e.trajectories for run in t.sequences()
    ]
    per_trajectory = sum(len(run[-1].prompt_ids) + len(run[-1].completion_ids) for run in runs)
    print(f"{len(outputs)} model calls in {args.episodes} tool-agent episodes; forward_backward:")
    for name, value in medians.items():
        print(f"  {name:24s} {value:.3f} s (median of {args.rounds})")
    ratio = medians["one row per turn"] / medians["one row per trajectory"]
    print(f"speedup: {ratio:.2f}x; tokens through the model {per_trajectory} vs {per_turn}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"medians_s": medians, "speedup": ratio, "calls": len(calls),
                  "tokens_per_trajectory": per_trajectory, "tokens_per_turn": per_turn}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
