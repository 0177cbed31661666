"""Crash soak: many countdown runs, each SIGKILLed at random phases and moments and resumed.

Every run (local backend, `builtin:tiny`, sync and async in turn) is killed `--kills` times at a
random phase (generation, training, weight sync, checkpoint write), on entry or a random moment
after, and resumed with `resume=true` after each kill (`bench/crashing.py`). The finished run is
checked as the test suite checks it: metrics steps continuous, every dispatched group ended
exactly once, every task the sampler drew accounted for, nothing half-written left; a sync run
must also end with the ledger and the bit-identical tensors of the same run never killed.

    python -m bench.crash_soak --runs 10 --kills 5 --json runs/bench-crash-soak.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.crashing import (
    PHASES,
    check_run,
    countdown_config,
    final_tensors,
    random_kills,
    run_life,
    train_with_kills,
)
from unified.checkpoint import RunDirectory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs, alternating sync and async")
    parser.add_argument("--kills", type=int, default=5, help="kills per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    steps = 2 * args.kills  # a life moves a run on by two steps at most (`random_kills`)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crash-soak-") as root:
        reference = countdown_config(Path(root), "reference", "sync", total_steps=steps)
        run_life(reference, None)
        kills_by_phase: Counter[str] = Counter()
        runs: list[dict[str, Any]] = []
        for index in range(args.runs):
            mode = ("sync", "async")[index % 2]
            config = countdown_config(Path(root), f"run{index}", mode, total_steps=steps)
            plan = random_kills(rng, PHASES, args.kills)
            killed = train_with_kills(config, plan)
            kills_by_phase.update(kill.phase for kill in plan[:killed])
            check = check_run(config)
            identical = None
            if mode == "sync":
                identical = _same_as(config, reference)
                if not identical:
                    check.problems.append("ledger or tensors differ from the run never killed")
            runs.append(
                {
                    "mode": mode,
                    "kills": killed,
                    "groups": check.groups,
                    "lost": check.lost,
                    "duplicated": check.duplicated,
                    "bit_identical": identical,
                    "problems": check.problems,
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    sync_runs = [r for r in runs if r["mode"] == "sync"]
    figures = {
        "runs": len(runs),
        "kills_survived": sum(r["kills"] for r in runs),
        "kills_by_phase": dict(kills_by_phase),
        "groups_checked": sum(r["groups"] for r in runs),
        "groups_lost": sum(r["lost"] for r in runs),
        "groups_duplicated": sum(r["duplicated"] for r in runs),
        "sync_runs_bit_identical": f"{sum(bool(r['bit_identical']) for r in sync_runs)}"
        f"/{len(sync_runs)}",
        "runs_with_problems": sum(bool(r["problems"]) for r in runs),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**figures, "per_run": runs}, indent=2) + "\n")
    if figures["runs_with_problems"]:
        sys.exit(1)


def _same_as(config: dict[str, Any], reference: dict[str, Any]) -> bool:
    def ledger(c: dict[str, Any]) -> list[Any]:
        return RunDirectory(Path(c["logging"]["run_dir"]) / c["name"]).read_ledger()

    ours, theirs = final_tensors(config), final_tensors(reference)
    tensors_equal = ours.keys() == theirs.keys() and all(
        torch.equal(ours[name], theirs[name]) for name in ours
    )
    return tensors_equal and ledger(config) == ledger(reference)


if __name__ == "__main__":
    main()
