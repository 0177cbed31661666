"""Async steps on the local backend: a speed setting against the behaviour before it.

In async mode the sampler samples the next batch while the trainer trains on the last, in one
process. `--compare split` (the default): shared, each uses every core (`local.sampler_threads`
set to all of them, the behaviour before the split), against split, the sampler's half and
training's the rest. `--compare reference`: the KL reference scored inline after the policy's
pass (`local.overlap_reference=false`, the behaviour before), against overlapped, in its own
thread on the sampler's share (the default). `--compare prefix-cache`: every prompt prefilled
whole (`local.prefix_cache_mb=0`), against an agent's later turns reusing the keys and values of
the conversation so far (the default). This trains the same config both ways for `--steps`
steps, in alternating rounds in one process, and prints the median `time/step` and `time/eval`
of each and their ratio (the old way's time over the new way's).

    python -m bench.threads --json runs/bench-threads.json
    python -m bench.threads --config examples/countdown/local_tool_async.yaml --steps 60
    python -m bench.threads --compare reference --config examples/countdown/local_tool_async.yaml
    python -m bench.threads --compare prefix-cache --config examples/countdown/local_tool_async.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from unified.config import load_config
from unified.trainer import UnifiedTrainer

ROOT = Path(__file__).resolve().parent.parent


def run(args: argparse.Namespace, run_dir: str, name: str, overrides: list[str]) -> list[dict]:
    config = load_config(
        ROOT / args.config,
        [
            f"name=bench-threads-{name}",
            f"logging.run_dir={run_dir}",
            "logging.console=false",
            f"trainer.total_steps={args.steps}",
            f"trainer.eval_every={args.eval_every}",
            "trainer.save_every=0",
            *overrides,
        ],
    )
    result = UnifiedTrainer(config).fit()
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/countdown/local_async.yaml")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--compare", choices=["split", "reference", "prefix-cache"], default="split"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    old, new = {
        "split": ("shared", "split"),
        "reference": ("inline", "overlap"),
        "prefix-cache": ("whole", "cached"),
    }[args.compare]
    old_overrides = {
        "split": [f"local.sampler_threads={cores}"],
        "reference": ["local.overlap_reference=false"],
        "prefix-cache": ["local.prefix_cache_mb=0"],
    }[args.compare]
    modes = {old: old_overrides, new: []}
    step: dict[str, list[float]] = {m: [] for m in modes}
    evals: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, overrides in modes.items():
                rows = run(args, tmp, f"{name}-{round_}", overrides)
                step[name] += [r["time/step"] for r in rows if "time/step" in r]
                evals[name] += [r["time/eval"] for r in rows if "time/eval" in r]
    medians = {
        m: {"step_s": statistics.median(step[m]), "eval_s": statistics.median(evals[m])}
        for m in modes
    }
    print(f"{args.config}, {args.steps} steps x {args.rounds} rounds each, {cores} threads:")
    for name, value in medians.items():
        print(f"  {name:6s} time/step {value['step_s']:.3f} s, time/eval {value['eval_s']:.3f} s")
    ratios = {k: medians[old][k] / medians[new][k] for k in ("step_s", "eval_s")}
    print(f"{new} is {ratios['step_s']:.2f}x per step, {ratios['eval_s']:.2f}x per evaluation")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "config": args.config,
            "compare": args.compare,
            "steps": args.steps,
            "threads": cores,
        }
        args.json.write_text(json.dumps({**report, "medians": medians, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
