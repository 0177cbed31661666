"""A 200-turn episode: memory and time of its steps' conversations, copied vs shared.

A `MultiTurnWorkflow` plays `--turns` turns against an echo environment and a zero-latency engine
whose outputs carry one prompt token, so what is measured is the conversation the steps hold
(token ids of a real engine's prompts are the backend's, one list per step, by contract). Two
ways to give each Step its prompt: `copy` (a list: `Step` copies it, what every step did before
`Transcript`) and `shared` (the `Transcript` snapshot `MultiTurnWorkflow` passes). Figures:
bytes the finished trajectory retains and the peak while it runs (`tracemalloc`), distinct
message objects held, and the episode's wall time (untraced).

    python -m bench.long_episode --turns 200 --json runs/bench-long-episode.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

from unified import ModelOutput, RolloutEngine, Step, Task, Trajectory
from workflows.multi_turn import Environment, MultiTurnWorkflow, Observation

REPLY = "x" * 40


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class _EchoEngine(RolloutEngine):
    """Replies at once; one prompt token, so the trajectory's size is its conversation."""

    @property
    def tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ModelOutput:
        return await self.complete([0])

    async def complete(self, prompt_ids: list[int], **sampling: Any) -> ModelOutput:
        return ModelOutput(
            text=REPLY, prompt_ids=prompt_ids, completion_ids=[1], logprobs=[-1.0],
            finish_reason="stop", policy_version=0,
        )  # fmt: skip


class _Echo:
    async def reset(self, task: Task) -> Observation:
        return "start " + "o" * 40

    async def step(self, action: str) -> tuple[Observation, float, bool]:
        return "observed " + action, 0.0, False


class _Shared(MultiTurnWorkflow):
    def environment(self, task: Task) -> Environment:
        return _Echo()


class _Copied(_Shared):
    """The same turns with one plain list, which each Step copies (the behaviour before)."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        env = self.environment(task)
        messages = [{"role": "user", "content": await env.reset(task)}]
        steps = []
        for _ in range(self.max_turns):
            output = await model.chat(messages)
            steps.append(Step(messages=messages, output=output))
            messages.append({"role": "assistant", "content": output.text})
            observation, _, _ = await env.step(output.text)
            messages.append({"role": "user", "content": observation})
        return Trajectory(steps=steps, reward=0.0)


async def _timed_run(workflow: MultiTurnWorkflow, into: list[Trajectory]) -> float:
    # The trajectory goes out through `into`, not as the result: Python 3.11's asyncio.run can
    # repr its task's result on exit (signal.getsignal), which would be timed and traced too.
    started = time.perf_counter()
    into.append(await workflow.run(Task(id="t"), _EchoEngine()))
    return time.perf_counter() - started


def _measure(workflow: MultiTurnWorkflow, turns: int, *, traced: bool) -> dict[str, float]:
    workflow.max_turns = turns
    gc.collect()
    if traced:
        tracemalloc.start()
    finished: list[Trajectory] = []
    seconds = asyncio.run(_timed_run(workflow, finished))
    trajectory = finished[0]
    gc.collect()
    retained, peak = tracemalloc.get_traced_memory() if traced else (0, 0)
    tracemalloc.stop()
    held = len({id(m) for s in trajectory.steps for m in s.messages})
    return {"retained_mb": retained / 2**20, "peak_mb": peak / 2**20, "seconds": seconds,
            "distinct_messages": held, "steps": len(trajectory.steps)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures = {}
    for name, workflow in (("copy", _Copied()), ("shared", _Shared())):
        # Memory with tracemalloc on; time in a second, untraced run (tracing slows allocation).
        figures[name] = _measure(workflow, args.turns, traced=True)
        figures[name]["seconds"] = _measure(workflow, args.turns, traced=False)["seconds"]
    for name, f in figures.items():
        print(
            f"{name:>6}: {f['steps']:.0f} steps, {f['distinct_messages']:.0f} distinct messages, "
            f"retained {f['retained_mb']:.2f} MB, peak {f['peak_mb']:.2f} MB, {f['seconds']:.3f} s"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"turns": args.turns, **figures}, indent=2))


if __name__ == "__main__":
    main()
