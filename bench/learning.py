"""Learning: countdown sync vs async from the same warm start, for the same wall-clock budget.

Each mode trains `examples/countdown/local_<mode>.yaml` for `--minutes`, evaluating on the
same 500 eval problems every `--eval-every` steps. Printed and written: eval accuracy against
wall time and against trained groups for both modes, accuracy at equal numbers of trained groups,
and the ratio of wall time per trained group (async / sync; below 1 means async is faster).

    python -m bench.learning --minutes 4 --json runs/bench-learning.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from unified.config import load_config
from unified.trainer import UnifiedTrainer

ROOT = Path(__file__).resolve().parent.parent


def run(mode: str, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    config = load_config(
        ROOT / "examples" / "countdown" / f"local_{mode}.yaml",
        [
            f"name=bench-{mode}",
            f"logging.run_dir={run_dir}",
            "logging.console=false",
            "trainer.total_steps=100000",
            f"trainer.max_time_s={args.minutes * 60}",
            f"trainer.eval_every={args.eval_every}",
            *args.overrides,
        ],
    )
    result = UnifiedTrainer(config).fit()
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed, curve = 0.0, []
    for r in rows:
        elapsed += r.get("time/step", 0.0)
        if "eval/accuracy" in r:
            groups = r["step"] * config.trainer.batch_size
            curve.append(
                {
                    "step": r["step"],
                    "groups": groups,
                    "minutes": elapsed / 60,
                    "accuracy": r["eval/accuracy"],
                }
            )
    return {
        "curve": curve,
        "steps": result.steps,
        "s_per_group": elapsed / (result.steps * config.trainer.batch_size),
    }


def accuracy_at(curve: list[dict[str, float]], groups: float) -> float:
    """Eval accuracy of the last evaluation at or before `groups` trained groups."""
    return max((p for p in curve if p["groups"] <= groups), key=lambda p: p["groups"])["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="training budget per mode")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides for both modes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, args, tmp) for mode in ("sync", "async")}
    common = min(results["sync"]["curve"][-1]["groups"], results["async"]["curve"][-1]["groups"])
    at_equal = {mode: accuracy_at(results[mode]["curve"], common) for mode in results}
    ratio = results["async"]["s_per_group"] / results["sync"]["s_per_group"]
    for mode, result in results.items():
        points = ", ".join(f"{p['minutes']:.1f} min {p['accuracy']:.1%}" for p in result["curve"])
        print(f"{mode:5s}: {result['steps']} steps; eval accuracy: {points}")
    gap = 100 * (at_equal["async"] - at_equal["sync"])
    print(
        f"at {common:.0f} trained groups: sync {at_equal['sync']:.1%}, "
        f"async {at_equal['async']:.1%} (difference {gap:+.1f} points)"
    )
    print(f"wall time per trained group, async / sync: {ratio:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "minutes": args.minutes,
            **results,
            "accuracy_at_equal_groups": at_equal,
            "time_per_group_ratio": ratio,
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
