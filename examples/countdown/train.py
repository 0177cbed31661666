"""Train countdown end to end: warm start (cached), RL, then a report and the curves.

    python -m examples.countdown.train examples/countdown/local_async.yaml [key=value ...]

Trains with `UnifiedTrainer`, which builds the warm start on first use (the configs' model
provider, `examples.countdown.prepare:warmstart_model`), then prints the greedy eval accuracy
before and after training (the mean of the last evaluations), for the tool agent
(`local_tool_*.yaml`) its calc calls per episode and their well-formed share too, the two
baselines it must beat, and where the reward-curve PNG, the report (`unified report`: curves,
timeline, every recorded episode) and the final checkpoint are.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from examples.countdown.baselines import baselines, best_pattern_by_target_band
from unified.checkpoint import RunDirectory
from unified.commands import run_command
from unified.config import TrainerConfig, load_config
from unified.errors import TrainingInterrupted, UsageError
from unified.imports import import_object
from unified.model_provider import resolve_model
from unified.plot import plot_run
from unified.report import write_report
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
    named = any(a.startswith("name=") for a in overrides)
    # A fresh run gets its own timestamped directory; resume=true continues the named one, or
    # without a name the newest of this config's runs that has a checkpoint.
    if config.resume:
        config.name = _run_to_resume(config, named=named).name
        print(f"countdown: resuming {config.run_path}", file=sys.stderr)
    elif not named:
        config.name = f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # The warm start is built on first use and cached: timed apart from the RL run.
    started = time.monotonic()
    config = resolve_model(config)
    build_minutes = (time.monotonic() - started) / 60
    trainer = UnifiedTrainer(config)
    started = time.monotonic()
    try:
        result = trainer.fit()
    except TrainingInterrupted as e:
        again = _resume_command(config_path, overrides, config.name)
        message = str(e).replace("continue with resume=true", f"continue with: {again}")
        raise TrainingInterrupted(message, signal_number=e.signal_number) from None
    minutes = (time.monotonic() - started) / 60
    summary = summarize(result.run_dir)
    first = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # A tool agent solves a task if any of its checks or its answer hits: its bars get as many
    # tries per task as it has turns.
    attempts = _attempts(config)
    reference = baselines(trainer.eval_tasks, attempts=attempts)
    curves = plot_run(result.run_dir)
    report, _ = write_report(result.run_dir)
    n = len(trainer.eval_tasks)
    built = (
        f" (after {build_minutes:.1f} min building the warm start)" if build_minutes > 0.05 else ""
    )
    resumed = result.resumed_from
    if resumed is None:
        ran = f"{result.steps} steps of RL in {minutes:.1f} min"
    elif resumed < result.steps:
        ran = f"steps {resumed + 1}-{result.steps} of RL in {minutes:.1f} min"
    else:
        ran = f"no steps of RL, the run had ended at step {resumed}"
    print(f"\ncountdown, {config.mode} on {config.backend}: {ran}{built}")
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
    print(f"  report (open in a browser): {report}")
    checkpoint = RunDirectory(result.run_dir).latest_checkpoint()
    if checkpoint is not None:
        print(f"  final checkpoint: {checkpoint}")
    return 0


_STAMP = re.compile(r"-\d{8}-\d{6}$")


def _run_to_resume(config: TrainerConfig, *, named: bool) -> Path:
    """The run directory `resume=true` continues: the named one, or the newest stamped run of
    this config; either must hold a checkpoint, else a usage error naming where it looked."""
    if named:
        runs = [config.run_path]
        where = str(config.run_path / "checkpoints")
    else:
        root = config.logging.run_dir
        runs = sorted(
            (p for p in root.glob(f"{glob.escape(config.name)}-*") if _STAMP.search(p.name)),
            reverse=True,  # the stamps sort by time
        )
        where = f"{root / config.name}-<date>-<time>/checkpoints"
    for run in runs:
        if RunDirectory(run).latest_checkpoint() is not None:
            return run
    raise UsageError(
        f"resume=true found no checkpoint to resume in {where}; leave out resume=true to start "
        "a new run, or name the run to continue with name=<run>"
    )


def _resume_command(config_path: str, overrides: list[str], name: str) -> str:
    """The command that continues run `name`: this script with the same overrides."""
    script = Path(config_path).with_suffix(".sh")
    module = f"python -m examples.countdown.train {config_path}"
    launch = f"bash {script}" if script.is_file() else module
    kept = [a for a in overrides if not a.startswith(("name=", "resume="))]
    return " ".join([launch, *map(shlex.quote, kept), f"name={name}", "resume=true"])


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
