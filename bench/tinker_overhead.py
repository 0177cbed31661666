"""Tinker overhead: the tinker backend on the local server vs the local backend, same recipe.

Both train countdown from the same cached warm start with `examples/countdown/<backend>_<mode>
.yaml` for `--steps` steps (no evaluation), one after the other in this process; the tinker run
goes through the real SDK, HTTP and the local Tinker-compatible server the backend starts. The
recipe is the same for both: the entropy bonus (an exact loss term on the local backend, a
sampled estimate folded into advantages on tinker) is switched off. Printed and written: the
median wall time per step of each (after `--warmup` steps) and their ratio (tinker / local; the
target is <= 1.5).

    python -m bench.tinker_overhead --steps 40 --json runs/bench-tinker-overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from unified.config import load_config
from unified.trainer import UnifiedTrainer

ROOT = Path(__file__).resolve().parent.parent


def run(backend: str, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    """Train `args.steps` steps on `backend`; the per-step wall times."""
    config = load_config(
        ROOT / "examples" / "countdown" / f"{backend}_{args.mode}.yaml",
        [
            f"name=bench-{backend}",
            f"logging.run_dir={run_dir}",
            "logging.console=false",
            f"trainer.total_steps={args.steps}",
            "trainer.eval_every=0",
            "trainer.eval_before_train=false",
            "trainer.entropy_coef=0",
            "trainer.lr_schedule=constant",
            *args.overrides,
        ],
    )
    result = UnifiedTrainer(config).fit()
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["time/step"] for r in rows if "time/step" in r][args.warmup :]
    return {
        "steps": result.steps,
        "median_step_s": statistics.median(step_s),
        "mean_step_s": statistics.fmean(step_s),
        "reward_last": result.metrics.get("reward/mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=40, help="steps per backend")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out")
    parser.add_argument("--mode", default="async", choices=["sync", "async"])
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    args = parser.parse_args()
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    # The tinker run must start its own local server, not reach for the service.
    os.environ.pop("TINKER_API_KEY", None)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory() as run_dir:
        figures: dict[str, Any] = {"mode": args.mode, "steps": args.steps}
        for backend in ("local", "tinker"):
            figures[backend] = run(backend, args, run_dir)
            print(
                f"{backend:6}: {figures[backend]['median_step_s'] * 1000:.0f} ms/step (median), "
                f"{figures[backend]['mean_step_s'] * 1000:.0f} ms/step (mean)",
                flush=True,
            )
    ratio = figures["tinker"]["median_step_s"] / figures["local"]["median_step_s"]
    figures["ratio"] = ratio
    print(f"tinker on the local server / local, wall time per step: {ratio:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
