"""Train countdown end to end: warm start (cached), RL, then a report and the curves.

    python -m examples.countdown.train examples/countdown/local_async.yaml [key=value ...]

Trains with `UnifiedTrainer`, which builds the warm start on first use (the configs' model
provider, `examples.countdown.prepare:warmstart_model`), then prints the greedy eval accuracy
before and after training (the mean of the last evaluations), for the tool agent
(`local_tool_*.yaml`) its calc calls per episode and their well-formed share too, the two
baselines it must beat, and where the reward-curve PNG and the final checkpoint are.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from examples.countdown.baselines import baselines, best_pattern_by_target_band
from unified.checkpoint import RunDirectory
from unified.commands import run_command
from unified.config import TrainerConfig, load_config
from unified.errors import UsageError
from unified.imports import import_object
from unified.model_provider import resolve_model
from unified.plot import plot_run
from unified.trainer import UnifiedTrainer
from workflows.tools import ToolWorkflow

__all__ = ["main", "summarize"]


def summarize(run_dir: Path, *, last: int = 3, metric: str = "eval/accuracy") -> dict[str, float]:
    """An eval metric before training and the mean of its last `last` evaluations."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r[metric]) for r in rows if metric in r]
    if not evals:
        raise UsageError(f"{run_dir} has no {metric}; set trainer.eval_every and data.eval")
    before = evals[0][1] if evals[0][0] == 0 else float("nan")
    trained = [value for step, value in evals if step > 0] or [evals[-1][1]]
    tail = trained[-last:]
    return {"before": before, "after": sum(tail) / len(tail), "evals_averaged": float(len(tail))}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    return run_command(lambda: _train_and_report(args[0], args[1:]), prog="countdown")


def _train_and_report(config_path: str, overrides: list[str]) -> int:
    config = load_config(config_path, overrides)
    # A fresh run gets its own timestamped directory; resume=true continues the named one.
    if not config.resume and not any(a.startswith("name=") for a in overrides):
        config.name = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # The warm start is built on first use and cached: timed apart from the RL run.
    started = time.monotonic()
    config = resolve_model(config)
    build_minutes = (time.monotonic() - started) / 60
    trainer = UnifiedTrainer(config)
    started = time.monotonic()
    result = trainer.fit()
    minutes = (time.monotonic() - started) / 60
    summary = summarize(result.run_dir)
    first = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # A tool agent solves a task if any of its checks or its answer hits: its bars get as many
    # tries per task as it has turns.
    attempts = _attempts(config)
    reference = baselines(trainer.eval_tasks, attempts=attempts)
    curves = plot_run(result.run_dir)
    n = len(trainer.eval_tasks)
    built = (
        f" (after {build_minutes:.1f} min building the warm start)" if build_minutes > 0.05 else ""
    )
    print(
        f"\ncountdown, {config.mode} on {config.backend}: {result.steps} steps of RL in "
        f"{minutes:.1f} min{built}"
    )
    print(f"  greedy eval accuracy on {n} problems, before training: {summary['before']:.1%}")
    print(
        f"  greedy eval accuracy after training (mean of the last "
        f"{int(summary['evals_averaged'])} evals): {summary['after']:.1%}"
    )
    if "eval/tool_calls" in result.metrics:
        calls = summarize(result.run_dir, metric="eval/tool_calls")
        print(
            f"  calc calls per eval episode, before: {calls['before']:.2f}, "
            f"after: {calls['after']:.2f}"
        )
        used, clean = (
            [_percent(m.get(key)) for m in (first, result.metrics)]
            for key in ("eval/tool_use", "eval/tool_use_well_formed")
        )
        print(f"  eval episodes calling calc, before: {used[0]}, at the last eval: {used[1]}")
        print(
            f"  ... with every call well-formed, before: {clean[0]}, at the last eval: {clean[1]}"
        )
    tries = "" if attempts == 1 else f" ({attempts} tries per problem, as the agent has turns)"
    print(
        f"  baseline, a random valid expression{tries}: {reference['random_valid_expression']:.1%}"
    )
    print(f"  baseline, the best fixed pattern{tries}: {reference['best_fixed_pattern']:.1%}")
    print(
        "  reference, the best pattern per band of ten targets: "
        f"{best_pattern_by_target_band(trainer.eval_tasks):.1%}"
    )
    print(f"  reward curves: {curves}")
    checkpoint = RunDirectory(result.run_dir).latest_checkpoint()
    if checkpoint is not None:
        print(f"  final checkpoint: {checkpoint}")
    return 0


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def _attempts(config: TrainerConfig) -> int:
    """Tries per task the agent has: the `max_turns` of a `ToolWorkflow`, or of the agent an
    `AgentWorkflow` runs (`workflow_args.agent`) when it declares one; else 1."""
    workflow = import_object(config.workflow, what="workflow")
    if isinstance(workflow, type) and issubclass(workflow, ToolWorkflow):
        return int(workflow.max_turns)
    agent = config.workflow_args.get("agent")
    if isinstance(agent, str):
        return int(getattr(import_object(agent, what="agent"), "max_turns", 1))
    return 1


if __name__ == "__main__":
    sys.exit(main())
