"""Every countdown script, interrupted and resumed as its own stop message says.

Each script runs as a user runs it (`bash examples/countdown/<script>.sh key=value ...`), shrunk
to a few steps of a built-in model; Ctrl-C (SIGINT) after its first step (with steps enough left
that the signal lands mid-run); then the command the message prints, verbatim: the run continues
in the same directory, its steps continue, and no group trains twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.test_stop import wait_for_stderr
from unified.checkpoint import RunDirectory
from unified.records import StepRecord, read_records

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (REPO / "examples" / "countdown").glob("*.sh"))
STEPS = 12
SMALL = [
    "model=builtin:tiny",
    f"trainer.total_steps={STEPS}",
    "trainer.batch_size=2",
    "trainer.group_size=2",
    "trainer.keep_per_group=null",
    "trainer.filter_groups=false",
    "trainer.warmup_steps=0",
    f"trainer.eval_every={STEPS}",
    "trainer.eval_before_train=false",
    "trainer.stop_grace_s=120",
    "data.train.n=64",
    "data.eval.n=4",
    "sampling.train.max_tokens=8",
    "sampling.eval.max_tokens=8",
]


def launch(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def script_env() -> dict[str, str]:
    """The scripts run this interpreter (`PYTHON`), offline, without Tinker's key."""
    env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    env.pop("TINKER_API_KEY", None)
    return env


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_stopped_with_ctrl_c_resumes_with_the_command_it_prints(
    script: str, tmp_path: Path
) -> None:
    env = script_env()
    first = launch(
        ["bash", f"examples/countdown/{script}.sh", *SMALL, f"logging.run_dir={tmp_path}"], env
    )
    try:
        wait_for_stderr(first, f"step 1/{STEPS}", timeout_s=300)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 130, err.decode()
    said = re.search(r"continue with: (.+)$", err.decode(), re.MULTILINE)
    assert said, f"the stop message prints a command that resumes: {err.decode()}"
    (run_path,) = tmp_path.iterdir()
    stopped = RunDirectory(run_path).latest_checkpoint()
    assert stopped is not None

    again = subprocess.run(
        ["bash", "-c", said.group(1)], cwd=REPO, env=env, capture_output=True, timeout=600
    )
    assert again.returncode == 0, again.stderr.decode()
    assert f"resuming {run_path}" in again.stderr.decode(), "the stopped run, not a new one"
    assert [p.name for p in tmp_path.iterdir()] == [run_path.name], "no second run directory"
    lines = (run_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(1, STEPS + 1)), "steps continue, none twice"
    trained = Counter(
        e.group_id for e in RunDirectory(run_path).read_ledger() if e.outcome == "trained"
    )
    assert trained and max(trained.values()) == 1, f"a group trained twice: {trained}"
    resumed_at = int(stopped.name.removeprefix("step_"))
    assert f": steps {resumed_at + 1}-{STEPS} of RL in " in again.stdout.decode()
    assert "final checkpoint: " in again.stdout.decode(), "the report names the checkpoint"
    assert f"report (open in a browser): {run_path}/report.html" in again.stdout.decode()
    assert (run_path / "report.html").is_file()
    records, _ = read_records(run_path)
    recorded_steps = [r.step for r in records if isinstance(r, StepRecord)]
    assert recorded_steps == list(range(1, STEPS + 1)), "the timeline has each step once"


def test_a_resume_with_nothing_to_resume_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "examples/countdown/local_sync.sh", *SMALL, f"logging.run_dir={tmp_path}",
         "resume=true"],
        cwd=REPO, env=script_env(), capture_output=True, timeout=120,
    )  # fmt: skip
    err = done.stderr.decode().strip()
    assert done.returncode == 2, err
    assert len(err.splitlines()) == 1 and "found no checkpoint" in err, err
    assert f"{tmp_path}/countdown-local-sync-<date>-<time>/checkpoints" in err, err
    assert not any(tmp_path.iterdir()), "nothing is created"


def test_resuming_a_finished_run_trains_nothing_and_says_so(tmp_path: Path) -> None:
    command = ["bash", "examples/countdown/local_sync.sh", *SMALL, f"logging.run_dir={tmp_path}"]
    first = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, timeout=300)
    assert first.returncode == 0, first.stderr.decode()
    again = subprocess.run(
        [*command, "resume=true"], cwd=REPO, env=script_env(), capture_output=True, timeout=300
    )
    assert again.returncode == 0, again.stderr.decode()
    assert f"no steps of RL, the run had ended at step {STEPS}" in again.stdout.decode()
