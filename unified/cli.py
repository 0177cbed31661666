"""The `unified` command: `train`, `sft`, `eval`, `plot` and `report` (`unified --help`).

A usage error (bad config, data, import path or capability) prints one line and exits 2;
a run that cannot make progress exits 1 with the reason; Ctrl-C exits 130 and SIGTERM 143 (during
`train`, after an orderly stop and a final checkpoint; see docs/reliability.md). Packages add
subcommands through the entry-point group `unified.commands` (name -> `module:function(argv)`
returning the exit code), e.g. the Tinker-compatible server's `tinker-serve`; the core never
imports them. Errors become exit codes in `unified.commands.run_command`, which they use too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from unified.commands import run_command
from unified.errors import UsageError

if TYPE_CHECKING:
    from unified.config import TrainerConfig

__all__ = ["main"]


def _contributed_commands() -> dict[str, EntryPoint]:
    """Subcommands other packages register under the entry-point group `unified.commands`."""
    return {ep.name: ep for ep in entry_points(group="unified.commands")}


def _parser(contributed: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unified", description="RL post-training for LLM policies and agents."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in contributed:
        commands.add_parser(name, help=f"see `unified {name} --help`", add_help=False)
    train = commands.add_parser("train", help="train a policy from a YAML config")
    train.add_argument("config", help="path to the YAML config")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.batch_size=16")
    train.add_argument(
        "--dry-run", action="store_true", help="print the resolved config and checks, then exit"
    )
    sft = commands.add_parser("sft", help="supervised fine-tuning on chat examples")
    sft.add_argument("config", help="YAML config; data.train is a jsonl of {messages: [...]}")
    sft.add_argument("overrides", nargs="*", help="dotted overrides")
    sft.add_argument("--output", help="model directory to write (default: runs/<name>/model)")
    evaluate = commands.add_parser("eval", help="evaluate a policy on the config's eval tasks")
    evaluate.add_argument("config", help="YAML config; data.eval and sampling.eval are used")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides")
    evaluate.add_argument(
        "--checkpoint", help="a checkpoint or a run directory (its newest); default: config.model"
    )
    evaluate.add_argument("--json", help="also write the metrics to this file")
    plot = commands.add_parser("plot", help="draw a run's curves into a PNG")
    plot.add_argument("run_dir", help="the run directory, runs/<name>")
    plot.add_argument("--output", help="PNG path (default: <run_dir>/curves.png)")
    report = commands.add_parser(
        "report", help="write a run's report.html: curves, timeline, episodes (no network)"
    )
    report.add_argument("run_dir", help="the run directory, runs/<name>")
    report.add_argument("--output", help="HTML path (default: <run_dir>/report.html)")
    report.add_argument(
        "--serve",
        type=int,
        metavar="PORT",
        help="serve the report on http://127.0.0.1:PORT/ instead, read afresh at each load "
        "(for a run still going); Ctrl-C stops",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    contributed = _contributed_commands()
    if argv and argv[0] in contributed:
        return _run_contributed(contributed[argv[0]], argv[1:])
    parser = _parser(sorted(contributed))
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after options too: `train cfg.yaml --dry-run a.b=1`.
    unknown = [arg for arg in extra if arg.startswith("-") or "=" not in arg]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    # Workflows and backends are named by import path relative to the project, as with `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return run_command(lambda: _dispatch(args))


def _run_contributed(entry: EntryPoint, argv: list[str]) -> int:
    """Run a registered subcommand; it parses its own arguments."""

    def run() -> int:
        try:
            command = entry.load()
        except ImportError as e:
            raise UsageError(
                f"command {entry.name!r} is registered but cannot be imported ({e}); "
                "install the extra that provides it"
            ) from e
        return int(command(argv))

    return run_command(run)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "train":
        return _train(args.config, args.overrides, dry_run=args.dry_run)
    if args.command == "sft":
        return _sft(args.config, args.overrides, output=args.output)
    if args.command == "eval":
        return _eval(args.config, args.overrides, checkpoint=args.checkpoint, json_path=args.json)
    if args.command == "report":
        return _report(args.run_dir, args.output, args.serve)
    from unified.plot import plot_run

    print(plot_run(args.run_dir, args.output))
    return 0


def _report(run_dir: str, output: str | None, port: int | None) -> int:
    from pathlib import Path

    from unified.report import serve_report, write_report

    if not Path(run_dir).is_dir():
        raise UsageError(f"{run_dir!r} is not a directory; give a run directory, runs/<name>")
    if port is not None:
        if output:
            raise UsageError("--serve and --output do not go together: serve, or write a file")
        if not 0 <= port <= 65535:
            raise UsageError(f"--serve {port}: a port is 0-65535 (0 picks a free one)")
        try:
            server = serve_report(run_dir, port)
        except OSError as e:
            raise UsageError(
                f"--serve {port}: cannot listen there ({e.strerror}); try another port"
            ) from e
        with server:
            url = f"http://127.0.0.1:{server.server_address[1]}/"
            print(
                f"serving the report of {run_dir} at {url} (read afresh at each load; Ctrl-C stops)"
            )
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                print("stopped")
        return 0
    if output and not Path(output).parent.is_dir():
        raise UsageError(f"--output {output!r}: its folder does not exist; create it first")
    path, warnings = write_report(run_dir, output)
    for warning in warnings:
        print(f"unified report: {warning}", file=sys.stderr)
    print(f"wrote {path}; open it in a browser (file://{path.resolve()})")
    return 0


def _train(config_path: str, overrides: Sequence[str], *, dry_run: bool) -> int:
    from unified.config import load_config
    from unified.protocol import resolve_tis_cap
    from unified.trainer import UnifiedTrainer

    config = load_config(config_path, overrides)
    trainer = UnifiedTrainer(config)
    if dry_run:
        cap = resolve_tis_cap(config, trainer.backend.capabilities)
        print(_resolved_yaml(trainer.config, trainer.backend), end="")
        print(
            f"# checks passed: backend {config.backend!r} honours every knob; workflow "
            f"{config.workflow!r} imports; {len(trainer.train_tasks)} train and "
            f"{len(trainer.eval_tasks)} eval tasks; truncated IS "
            f"{'off' if cap is None else f'cap {cap}'}"
        )
        return 0
    result = trainer.fit()
    accuracy = result.metrics.get("eval/accuracy")
    shown = f", eval/accuracy {accuracy:.3f}" if accuracy is not None else ""
    resumed = "" if result.resumed_from is None else f" (resumed at step {result.resumed_from})"
    print(f"trained {result.steps} steps{resumed}{shown}; run directory: {result.run_dir}")
    return 0


def _resolved_yaml(config: TrainerConfig, backend: object) -> str:
    """The config as the run will see it: the chosen backend's section with its defaults filled
    in (from its `section_model`, when it has one), the other backends' empty sections left out."""
    import yaml
    from pydantic import BaseModel

    from unified.config import backend_section
    from unified.redaction import redact_config

    data = config.public_dump()
    model = getattr(type(backend), "section_model", None)
    if isinstance(model, type) and issubclass(model, BaseModel) and config.backend in data:
        section = backend_section(model, config, config.backend).model_dump(mode="json")
        data[config.backend] = redact_config({config.backend: section})[config.backend]
    for name in ("local", "tinker", "verl"):
        if name != config.backend and data.get(name) == {}:
            del data[name]
    return yaml.safe_dump(data, sort_keys=False)


def _sft(config_path: str, overrides: Sequence[str], *, output: str | None) -> int:
    import asyncio
    from pathlib import Path

    from unified.config import load_config
    from unified.sft import run_sft

    config = load_config(config_path, overrides)
    target = Path(output) if output else config.run_path / "model"
    exported = (target / "config.json").is_file()
    if target.exists() and not exported and (not target.is_dir() or any(target.iterdir())):
        # Exporting replaces the target whole: never another run's files, nor a folder.
        raise UsageError(
            f"--output {target} exists and is not a model directory; it would be replaced: "
            "give a new path, or an earlier export (a directory holding config.json)"
        )
    asyncio.run(run_sft(config, output=target))
    print(f"wrote the fine-tuned model to {target}")
    return 0


def _eval(
    config_path: str, overrides: Sequence[str], *, checkpoint: str | None, json_path: str | None
) -> int:
    import asyncio
    import json
    from pathlib import Path

    from unified.config import load_config
    from unified.evaluation import run_eval

    config = load_config(config_path, overrides)
    if json_path and not Path(json_path).parent.is_dir():
        raise UsageError(f"--json {json_path!r}: its folder does not exist; create it first")
    if json_path and Path(json_path).is_dir():
        raise UsageError(f"--json {json_path!r} is a folder; give a file path, e.g. eval.json")
    source = Path(checkpoint) if checkpoint else None
    metrics = asyncio.run(run_eval(config, checkpoint=source))
    step = int(metrics["eval/step"])
    scored = f"the policy of {source} at step {step}" if source else f"{config.model} (step 0)"
    print(f"unified eval: scored {scored}", file=sys.stderr)
    text = json.dumps(metrics, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
