"""Pipeline efficiency: wall time per trained group, sync vs async, on a simulated workload.

Generation is simulated by heavy-tailed asyncio sleeps per rollout (a remote sampler), training
by a blocking sleep in a worker thread per `forward_backward` (an accelerator busy elsewhere), on
the bandit test backend. Both loops run in this process on the same workload; the figure is the
ratio of their wall times per trained group, which is what the async loop's overlap buys.

    python bench/pipeline.py --json runs/bench-pipeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.bandit import BanditBackend, bandit_tasks
from unified import TrajectoryGroup, UnifiedTrainer


class SimulatedBackend(BanditBackend):
    """The bandit, with generation latency and a training cost per group."""

    def __init__(self, gen_s: float, train_s_per_group: float) -> None:
        super().__init__(latency=self._latency)
        self.gen_s = gen_s
        self.train_s_per_group = train_s_per_group

    async def _latency(self, seed: int) -> None:
        heavy = min(10.0, random.Random(seed).paretovariate(1.5))
        await asyncio.sleep(self.gen_s * heavy)

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        await asyncio.to_thread(time.sleep, self.train_s_per_group * len(groups))
        return await super().forward_backward(groups)


def run(mode: str, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    backend = SimulatedBackend(args.gen_ms / 1000, args.train_ms / 1000)
    config: dict[str, Any] = {
        "name": mode,
        "mode": mode,
        "workflow": "tests.bandit:BanditWorkflow",
        "trainer": {
            "total_steps": args.steps,
            "batch_size": args.batch,
            "group_size": args.group,
            "lr": 0.01,
            "eval_every": 0,
            "save_every": 0,
            "seed": args.seed,
        },
        "async": {"max_staleness": args.staleness},
        "logging": {"run_dir": str(run_dir), "console": False},
    }
    trainer = UnifiedTrainer(config, backend=backend, train_tasks=bandit_tasks(256, target=1))
    started = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - started
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    idle = sum(m["trainer/idle_ratio"] for m in lines) / len(lines)
    return {"wall_s": wall, "s_per_group": wall / (args.steps * args.batch), "trainer_idle": idle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--gen-ms", type=float, default=20.0, help="median rollout latency")
    parser.add_argument("--train-ms", type=float, default=10.0, help="training cost per group")
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = {mode: run(mode, args, Path(tmp)) for mode in ("sync", "async")}
    speedup = figures["sync"]["s_per_group"] / figures["async"]["s_per_group"]
    report = {"config": vars(args) | {"json": None}, **figures, "async_speedup": speedup}
    for mode in ("sync", "async"):
        f = figures[mode]
        print(
            f"{mode:5s}: {f['wall_s']:.2f} s, {1000 * f['s_per_group']:.1f} ms/group, "
            f"trainer idle {f['trainer_idle']:.0%}"
        )
    print(f"async speedup (sync time / async time per trained group): {speedup:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
