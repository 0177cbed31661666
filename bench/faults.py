"""Fault injection: every run completes, or fails fast with a message naming who waited on whom.

Runs the real trainer with faults injected and reports what was injected and what happened,
each against a clean run of the same shape in the same process (time ratio):

- workflows (bandit test backend): 10% raise, 5% hang until `trainer.workflow_timeout_s`; sync
  and async;
- a backend call that never returns (`optim_step`): seconds until the run fails, vs the deadline;
- the local Tinker server (`--tinker`): HTTP 500 and 429 bursts on every work endpoint, and a
  server that answers slower than `tinker.request_timeout_s`;
- the bad-input table of `tests/test_bad_input.py`, run by pytest: rows tried, rows that exit 2
  in one line.

    python -m bench.faults --tinker --json runs/bench-faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unified import UnifiedTrainer
from unified.errors import UnifiedError
from unified.testing import BanditBackend, StuckOptimStep, bandit_tasks, digits_tasks


def bandit_config(run_dir: str, name: str, mode: str, **trainer: Any) -> dict[str, Any]:
    return {
        "name": name,
        "mode": mode,
        "workflow": "unified.testing:BanditWorkflow",
        "trainer": {
            "total_steps": 20,
            "batch_size": 4,
            "group_size": 4,
            "lr": 0.1,
            "filter_groups": False,  # the bandit learns fast; equal-reward groups still train
            "eval_every": 0,
            "eval_before_train": False,
            "save_every": 0,
            "workflow_timeout_s": 0.5,
            **trainer,
        },
        "logging": {"run_dir": run_dir, "console": False},
    }


def run(config: dict[str, Any], backend: BanditBackend | None = None) -> dict[str, Any]:
    """Train; return steps, seconds, failures counted, or the error that ended the run."""
    started = time.monotonic()
    trainer = UnifiedTrainer(
        config, backend=backend or BanditBackend(), train_tasks=bandit_tasks(64)
    )
    try:
        result = trainer.fit()
    except UnifiedError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    return {
        "steps": result.steps,
        "seconds": time.monotonic() - started,
        "episode_errors": sum(r["episodes/errors"] for r in rows),
        "episode_timeouts": sum(r["episodes/timeouts"] for r in rows),
    }


def workflow_faults(tmp: str) -> dict[str, Any]:
    report = {}
    for mode in ("sync", "async"):
        clean = run(bandit_config(tmp, f"clean-{mode}", mode))
        faulty = run(
            {
                **bandit_config(tmp, f"faulty-{mode}", mode, max_error_rate=0.5),
                "workflow": "unified.testing:FlakyWorkflow",
            }
        )
        faulty["time_over_clean"] = faulty["seconds"] / clean["seconds"]
        report[mode] = {"clean": clean, "faulty": faulty}
        print(
            f"workflows {mode}: {faulty['steps']} of 20 steps with {faulty['episode_errors']:.0f} "
            f"errors and {faulty['episode_timeouts']:.0f} hangs injected; "
            f"{faulty['time_over_clean']:.2f}x the clean run's time"
        )
    return report


def stuck_call(tmp: str) -> dict[str, Any]:
    deadline = 1.0
    got = run(bandit_config(tmp, "stuck", "async", backend_timeout_s=deadline), StuckOptimStep())
    got["deadline_s"] = deadline
    print(f"stuck optim_step: failed after {got['seconds']:.2f} s (deadline {deadline:g} s)")
    print(f"  {got['error']}")
    return got


def tinker_faults(tmp: str) -> dict[str, Any]:
    from tinker_server.faults import Faults
    from tinker_server.server import LocalServer

    def config(url: str, name: str, **tinker: Any) -> dict[str, Any]:
        return {
            "name": name,
            "backend": "tinker",
            "workflow": "unified.testing:DigitsWorkflow",
            "model": "builtin:tiny",
            "trainer": {
                "total_steps": 3,
                "batch_size": 4,
                "group_size": 4,
                "lr": 1e-2,
                "eval_every": 0,
                "eval_before_train": False,
                "save_every": 0,
            },
            "sampling": {"train": {"max_tokens": 8}},
            "tinker": {"lora_rank": 8, "base_url": url, "request_timeout_s": 60, **tinker},
            "logging": {"run_dir": tmp, "console": False},
        }

    def fit(faults: Faults, name: str, **tinker: Any) -> dict[str, Any]:
        """Train against a fresh server; `seconds` is the run alone, not the server's start/stop."""
        server = LocalServer("builtin:tiny", store=Path(tmp) / f"store-{name}", faults=faults)
        try:
            url = server.start(timeout_s=120)
            started = time.monotonic()
            try:
                trainer = UnifiedTrainer(config(url, name, **tinker), train_tasks=digits_tasks())
                result = trainer.fit()
                got: dict[str, Any] = {"steps": result.steps}
            except UnifiedError as e:
                got = {"error": f"{type(e).__name__}: {e}"}
            got["seconds"] = time.monotonic() - started
        finally:
            server.stop()
        return {**got, "injected": dict(server.injected)}

    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    fit(Faults(), "warm-up")  # the first run in a process pays for imports and caches
    clean = fit(Faults(), "clean")
    bursts = fit(Faults(http_500_rate=0.15, http_429_rate=0.1, seed=3), "bursts")
    bursts["time_over_clean"] = bursts["seconds"] / clean["seconds"]
    slow = fit(Faults(latency_s=30.0), "slow", request_timeout_s=2.0, retries=1)
    print(
        f"tinker 5xx/429 bursts: {bursts.get('steps')} of 3 steps, injected {bursts['injected']}; "
        f"{bursts['time_over_clean']:.2f}x the clean run's time"
    )
    print(f"tinker server slower than the deadline: failed after {slow['seconds']:.1f} s")
    print(f"  {slow.get('error')}")
    return {"clean": clean, "bursts": bursts, "slow": slow}


def bad_inputs() -> dict[str, Any]:
    """Run the bad-input table (`tests/test_bad_input.py`, each row asserts exit 2 with one
    line naming the problem) and count its rows that pass."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_bad_input.py",
         "-k", "test_bad_input_is_one_line_exit_2_and_no_run_directory"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error)", summary)}
    tried = sum(counts.values())
    print(f"bad inputs: {counts.get('passed', 0)} of {tried} rows exit 2 with one line")
    return {"tried": tried, "one_line_exit_2": counts.get("passed", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tinker", action="store_true", help="also the local Tinker server")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report: dict[str, Any] = {
            "workflows": workflow_faults(tmp),
            "stuck_call": stuck_call(tmp),
            "bad_inputs": bad_inputs(),
        }
        if args.tinker:
            report["tinker"] = tinker_faults(tmp)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
