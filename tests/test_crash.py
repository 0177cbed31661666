"""Crash and resume: countdown on the local backend SIGKILLed in every phase, in both modes.

Each case kills a run three times at one phase (generation, training, weight sync, checkpoint
write), on entry or a random moment after, resuming after each kill; the finished run must look
as if it had never been killed. 2 modes x 4 phases x 3 kills = 24 kills; `bench/crash_soak.py`
runs many more at random phases.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.crashing import (
    PHASES,
    Phase,
    check_run,
    countdown_config,
    final_tensors,
    random_kills,
    run_life,
    train_with_kills,
)
from tests.conftest import ConfigFactory
from unified import UnifiedTrainer
from unified.checkpoint import RunDirectory
from unified.testing import BanditBackend, bandit_tasks

KILLS_PER_CASE = 3
STEPS = 2 * KILLS_PER_CASE  # each life moves the run on by two steps at most


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same sync run, never killed."""
    config = countdown_config(
        tmp_path_factory.mktemp("reference"), "reference", "sync", total_steps=STEPS
    )
    assert not run_life(config, None)
    return config


def ledger_of(config: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    run = RunDirectory(Path(config["logging"]["run_dir"]) / config["name"])
    return [(e.group_id, e.outcome, e.step, e.trainer_version) for e in run.read_ledger()]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_killed_and_resumed_ends_every_group_once_with_steps_continuous(
    tmp_path: Path, mode: str, phase: Phase, request: pytest.FixtureRequest
) -> None:
    kills = random_kills(random.Random(f"{mode}-{phase}"), (phase,), KILLS_PER_CASE)
    config = countdown_config(tmp_path, "killed", mode, total_steps=STEPS)
    killed = train_with_kills(config, kills)
    assert killed == KILLS_PER_CASE, f"only {killed} of {kills} happened before the run finished"
    check = check_run(config)
    assert not check.problems, f"after kills {kills}: {check.problems}"
    if mode == "sync":
        reference = request.getfixturevalue("sync_reference")
        assert ledger_of(config) == ledger_of(reference), (
            "a resumed sync run trains the same groups"
        )
        ours, theirs = final_tensors(config), final_tensors(reference)
        assert ours.keys() == theirs.keys()
        differ = [name for name in ours if not torch.equal(ours[name], theirs[name])]
        assert not differ, (
            f"after kills {kills}, tensors differ from the uninterrupted run: {differ}"
        )


# -- in process: what resume does with a crashed run's directory --------------------------------


def test_resume_from_a_mid_run_checkpoint_dispatches_groups_in_flight_under_their_own_ids(
    make_config: ConfigFactory,
) -> None:
    """A sync checkpoint holds the next step's groups, dispatched before it was written; they
    keep their ids (and rollout seeds), so the resumed run trains what the full run trained."""
    config = make_config(name="full", trainer={"total_steps": 6, "save_every": 2})
    full = UnifiedTrainer(config, backend=BanditBackend(), train_tasks=bandit_tasks(24)).fit()
    crashed = full.run_dir.parent / "crashed"
    shutil.copytree(full.run_dir, crashed)
    for late in ("step_000004", "step_000006"):  # as if killed after step 6's ledger lines
        shutil.rmtree(crashed / "checkpoints" / late)
    assert RunDirectory.load_state(crashed / "checkpoints" / "step_000002").redispatch
    resumed = UnifiedTrainer(
        {**config, "name": "crashed", "resume": True},
        backend=BanditBackend(),
        train_tasks=bandit_tasks(24),
    ).fit()
    entries = RunDirectory(resumed.run_dir).read_ledger()
    assert entries == RunDirectory(full.run_dir).read_ledger(), "the same groups, once each"
    steps = [json.loads(ln)["step"] for ln in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], "metrics lines past the checkpoint were dropped, redone"


def test_resume_drops_a_ledger_line_torn_by_a_crash_and_temporary_checkpoints(
    make_config: ConfigFactory,
) -> None:
    config = make_config(name="torn", trainer={"total_steps": 2, "save_every": 2})
    result = UnifiedTrainer(config, backend=BanditBackend(), train_tasks=bandit_tasks(24)).fit()
    run = RunDirectory(result.run_dir)
    lines = len(run.read_ledger())
    with run.ledger_path.open("a") as f:
        f.write('{"group_id": "g0000')  # the start of a line the crash cut off
    (run.checkpoints / ".tmp-step_000004" / "backend").mkdir(parents=True)
    run.create(result.run_dir.joinpath("config.yaml").read_text(), resume=True)
    assert len(run.read_ledger()) == lines
    assert run.ledger_path.read_text().endswith("}\n"), "the torn tail is gone from the file"
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_000002"]


async def test_the_newest_readable_checkpoint_by_step_number_is_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Names sort as text (`step_1000000` before `step_999999`), and a state emptied by a crash
    of the machine must fall back to the checkpoint before it, not stop the resume."""
    from unified.checkpoint import TrainerState

    run = RunDirectory(tmp_path / "run")

    async def no_backend(directory: Path) -> None:
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)

    for step in (999_999, 1_000_000, 1_000_001):
        state = TrainerState(step=step, version=step, next_seq=0, sampler={}, redispatch=[])
        await run.save_checkpoint(state, no_backend)
    assert run.latest_checkpoint() == run.checkpoints / "step_1000001"
    (run.checkpoints / "step_1000001" / "trainer_state.json").write_text("")
    assert run.latest_checkpoint() == run.checkpoints / "step_1000000"
    assert "step_1000001 is unreadable" in caplog.text
