"""Partial rollouts on the local sampler: token freshness and sampling cost, on against off.

Requests with long-tailed `max_tokens` (lognormal, capped) stream through the local backend's
sampler from `--concurrency` workers while a stand-in trainer syncs the weights after every
`--requests-per-sync` finished requests. The synced weights are the same weights, so both modes
sample the same tokens (a cut request continues from its seed's next uniform) and do the same
work apart from the re-prefills: the comparison isolates scheduling. Per mode: generated tokens
per second, the mean lag of a token (versions between the weights that sampled it and the
weights current when its request returned), request latency, and the share of completions equal
to the other mode's. Rounds alternate between the modes in one process; figures are medians and
ratios partial / whole.

    python -m bench.partial_rollout --json runs/bench-partial.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from backends.local.backend import LocalBackend
from examples.countdown.tasks import make_tasks, prompt
from unified.config import load_config
from unified.rollout import SamplingEngine
from unified.types import ModelOutput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-per-sync", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=192, help="cap of the lognormal")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = asyncio.run(_compare(args))
    for mode in ("whole", "partial"):
        r = report[mode]
        print(
            f"{mode:8s} {r['tokens_per_s']:7.0f} tokens/s  mean token lag "
            f"{r['mean_token_lag']:.2f} versions  latency mean {r['latency_mean_s']:.2f} s "
            f"p90 {r['latency_p90_s']:.2f} s  batches {r['batches']:.0f}"
        )
    ratios = report["partial_over_whole"]
    print(
        f"partial / whole: tokens/s {ratios['tokens_per_s']:.2f}x, mean token lag "
        f"{ratios['mean_token_lag']:.2f}x, latency mean {ratios['latency_mean_s']:.2f}x; "
        f"same completions {report['same_completions']:.0%}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


async def _compare(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config({"workflow": "unused:unused", "model": args.model, "mode": "async"})
    backend = LocalBackend()
    await backend.setup(config)
    rng = random.Random(0)
    lengths = [
        max(1, min(args.max_tokens, int(8 * rng.lognormvariate(1.0, 1.0))))
        for _ in range(args.requests)
    ]
    messages = [[{"role": "user", "content": prompt(t.data)}] for t in make_tasks(args.requests)]
    await _round(backend, args, messages[:8], lengths[:8])  # warm-up, not counted
    rounds: dict[str, list[dict[str, float]]] = {"whole": [], "partial": []}
    outputs: dict[str, list[ModelOutput]] = {}
    for _ in range(args.rounds):
        for mode in ("whole", "partial"):
            backend.sampler.partial_rollout = mode == "partial"
            figures, outputs[mode] = await _round(backend, args, messages, lengths)
            rounds[mode].append(figures)
    await backend.shutdown()
    report: dict[str, Any] = {
        mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for mode, runs in rounds.items()
    }
    report["partial_over_whole"] = {
        key: report["partial"][key] / report["whole"][key]
        for key in ("tokens_per_s", "mean_token_lag", "latency_mean_s", "latency_p90_s")
    }
    same = sum(
        a.completion_ids == b.completion_ids
        for a, b in zip(outputs["whole"], outputs["partial"], strict=True)
    )
    report["same_completions"] = same / args.requests
    report["settings"] = vars(args) | {"json": str(args.json)}
    return report


async def _round(
    backend: LocalBackend,
    args: argparse.Namespace,
    messages: list[list[dict[str, str]]],
    lengths: list[int],
) -> tuple[dict[str, float], list[ModelOutput]]:
    engine = SamplingEngine(backend.token_sampler())
    queue = list(range(len(messages)))
    results: list[ModelOutput | None] = [None] * len(messages)
    lags: list[int] = []
    latencies: list[float] = []
    finished = syncs_due = 0
    wake = asyncio.Event()  # a sync is due, or every request finished
    batches = backend.sampler.batches

    async def worker() -> None:
        nonlocal finished, syncs_due
        while queue:
            i = queue.pop(0)
            started = time.perf_counter()
            out = await engine.chat(
                messages[i], temperature=1.0, top_p=1.0, max_tokens=lengths[i], stop=[], seed=i
            )
            latencies.append(time.perf_counter() - started)
            now = backend.sampler.version
            versions = out.token_versions or [out.policy_version] * len(out.completion_ids)
            lags.extend(now - v for v in versions)
            results[i] = out
            finished += 1
            syncs_due += finished % args.requests_per_sync == 0
            wake.set()

    async def trainer() -> None:
        nonlocal syncs_due
        version = backend.sampler.version
        while finished < len(messages):
            async with asyncio.timeout(600):
                await wake.wait()
            wake.clear()
            while syncs_due and finished < len(messages):
                syncs_due -= 1
                version += 1
                await backend.on_policy_updated(version)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        group.create_task(trainer())
        for _ in range(args.concurrency):
            group.create_task(worker())
    elapsed = time.perf_counter() - started
    done = [r for r in results if r is not None]
    tokens = sum(len(r.completion_ids) for r in done)
    latencies.sort()
    figures = {
        "tokens_per_s": tokens / elapsed,
        "mean_token_lag": sum(lags) / max(1, len(lags)),
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
        "batches": float(backend.sampler.batches - batches),
    }
    return figures, done


if __name__ == "__main__":
    main()
