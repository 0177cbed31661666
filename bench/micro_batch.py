"""The local backend's training pass at several micro-batch sizes, on one step's batch.

Samples one training step's episodes of a config (its warm start, its train settings), then
times `forward_backward` on that batch with `local.forward_batch_size` at each size, in alternating
rounds in one process, at each thread count, and prints the medians and their ratio to the
first size. The gradients are the same at every size (tests/test_local_backend.py).

    python -m bench.micro_batch --json runs/bench-micro-batch.json
    python -m bench.micro_batch --config examples/countdown/local_async.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import torch

from backends.local.backend import LocalBackend
from bench.multiturn_scoring import sample_groups, time_pass
from unified.config import load_config
from unified.model_provider import resolve_model
from unified.types import TrajectoryGroup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/countdown/local_tool_async.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 32, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = resolve_model(load_config(args.config))
    backend = LocalBackend()
    t = config.trainer

    async def prepare() -> list[TrajectoryGroup]:
        await backend.setup(config)
        return await sample_groups(backend, t.batch_size * t.group_size, t.group_size)

    groups = asyncio.run(prepare())
    runs = [r for g in groups for e in g.episodes for tr in e.trajectories for r in tr.sequences()]
    rows = [len(run[-1].prompt_ids) + len(run[-1].completion_ids) for run in runs]
    print(
        f"{args.config}: {len(rows)} rows of {min(rows)}-{max(rows)} tokens (mean "
        f"{statistics.mean(rows):.0f}); forward_backward, median of {args.rounds}:"
    )
    report: dict[str, dict[str, float]] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)  # this thread runs the passes
        times: dict[int, list[float]] = {size: [] for size in args.sizes}
        time_pass(backend, groups)  # warm-up
        for _ in range(args.rounds):
            for size in args.sizes:
                backend.settings.forward_batch_size = size
                times[size].append(time_pass(backend, groups))
        medians = {size: statistics.median(v) for size, v in times.items()}
        first = medians[args.sizes[0]]
        line = ", ".join(f"{s}: {m:.3f} s ({first / m:.2f}x)" for s, m in medians.items())
        print(f"  {threads} thread(s): {line}")
        report[str(threads)] = {str(s): m for s, m in medians.items()}
    asyncio.run(backend.shutdown())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": args.config, "medians_s": report}, indent=2))


if __name__ == "__main__":
    main()
