"""The bad-input table: malformed configs, datasets, rewards, workflow returns, backend replies.

Each row runs `unified train` (in-process; a few as real subprocesses) on the bandit demo with
one thing broken, and asserts exit code 2, one line on stderr that names the problem, and no
run directory left behind. A workflow's own bug is not bad input: it keeps its traceback.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from unified.cli import main
from unified.config import RENAMED_KEYS, load_config
from unified.errors import ConfigError

DEMO = Path(__file__).with_name("demo.yaml")
RUN = "bandit-demo"


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


Setup = Callable[[Path], list[str]]


def override(*items: str) -> Setup:
    return lambda _: list(items)


def config_file(text: str) -> Setup:
    return lambda tmp: ["--config", str(write(tmp / "bad.yaml", text))]


def train_file(name: str, text: str | bytes, key: str = "data.train") -> Setup:
    return lambda tmp: [f"{key}={write(tmp / name, text)}"]


def workflow(name: str) -> Setup:
    return override(f"workflow=tests.faulty:{name}")


def backend(name: str) -> Setup:
    return override(f"backend=tests.faulty:{name}")


def existing_run(tmp: Path) -> list[str]:
    (tmp / "runs" / RUN).mkdir(parents=True)
    write(tmp / "runs" / RUN / "metrics.jsonl", "{}\n")
    return []


def run_dir_a_file(tmp: Path) -> list[str]:
    (tmp / "runs").mkdir()
    write(tmp / "runs" / RUN, "not a directory\n")
    return []


ROWS: dict[str, tuple[Setup, str]] = {
    # configs
    "config file missing": (lambda tmp: ["--config", str(tmp / "nope.yaml")], "does not exist"),
    "config file a folder": (lambda tmp: ["--config", str(tmp)], "is a folder; give a YAML file"),
    "config not YAML": (config_file("trainer: [1,\n"), "is not valid YAML"),
    "config a list": (config_file("- 1\n- 2\n"), "must hold a mapping"),
    "unknown key": (override("trainer.bach_size=3"), "unknown config key 'trainer.bach_size'"),
    "wrong type": (override("trainer.batch_size=lots"), "config key 'trainer.batch_size'"),
    "negative staleness": (override("async.max_staleness=-1"), "greater than or equal to 0"),
    "micro batch > batch": (override("trainer.micro_batch_size=99"), "micro_batch_size (99)"),
    "stall clock under an episode's": (
        override("trainer.stall_timeout_s=30", "trainer.workflow_timeout_s=60"),
        "trainer.stall_timeout_s (30) must exceed trainer.workflow_timeout_s (60)",
    ),
    "renamed key": (
        override("trainer.workflow_timeout=60"),
        "trainer.workflow_timeout was renamed trainer.workflow_timeout_s",
    ),
    "unknown mode": (override("mode=turbo"), "config key 'mode'"),
    "unknown loss": (override("trainer.loss=nope"), "config key 'trainer.loss'"),
    "error rate > 1": (override("trainer.max_error_rate=2"), "trainer.max_error_rate"),
    "bad run name": (override("name=a/b"), "config key 'name'"),
    "run name '..'": (override("name=.."), "not '.' or '..'"),
    "config not UTF-8": (
        lambda tmp: ["--config", str(write(tmp / "bad.yaml", b"name: caf\xe9\n"))],
        "is not UTF-8 text",
    ),
    "config anchor in itself": (config_file("local: &a {x: *a}\n"), "alias inside its own"),
    "config key a date": (config_file("2024-01-01: x\n"), "Keys should be strings"),
    "relative import path": (override("workflow=.flows:Agent"), "cannot import module '.flows'"),
    "NaN tis_cap": (override("trainer.tis_cap=.nan"), "must be >= 1"),
    "override not YAML": (override("trainer.batch_size=[1"), "value is not valid YAML"),
    "override into a value": (override("name.x=1"), "'name' is not a section"),
    "bad retry policy": (override("trainer.retry.save_checkpoint.attempts=0"), "attempts"),
    "workflow module missing": (override("workflow=no_such_module:Flow"), "no_such_module"),
    "workflow attr missing": (override("workflow=unified.testing:Nope"), "has no attribute"),
    "workflow not async": (override("workflow=unified.testing:bandit_tasks"), "not an async"),
    "unknown backend": (override("backend=quantum"), "unknown backend 'quantum'"),
    "unsupported knob": (override("async.partial_rollout=true"), "not supported by backend"),
    "key in config": (
        override("backend=tinker", "tinker.api_key=tml-in-the-file"),
        "keys are read from the environment only",
    ),
    "run already exists": (existing_run, "already holds a run"),
    "run directory a file": (run_dir_a_file, "is a file; check logging.run_dir and name"),
    # datasets
    "dataset missing": (override("data.train=/no/such/tasks.jsonl"), "does not exist"),
    "dataset empty": (train_file("empty.jsonl", ""), "data.train is empty"),
    "eval dataset empty": (train_file("empty.jsonl", "", "data.eval"), "data.eval is empty"),
    "line not JSON": (train_file("t.jsonl", '{"target": 1}\n{oops\n'), "line 2"),
    "row not an object": (train_file("t.jsonl", "[1, 2]\n"), "expected an object"),
    "field missing": (
        train_file("t.jsonl", '{"id": "a", "target": 1}\n{"id": "b", "goal": 2}\n'),
        "task 'b' has no field 'target', which the workflow reads",
    ),
    "id of wrong type": (train_file("t.jsonl", '{"id": [1], "target": 1}\n'), "an id must be"),
    "duplicate ids": (
        train_file("t.jsonl", '{"id": "a", "target": 1}\n{"id": "a", "target": 2}\n'),
        "duplicate task id 'a'",
    ),
    "not UTF-8": (train_file("t.jsonl", b'{"target": "\xff\xfe"}\n'), "not UTF-8"),
    "unsupported suffix": (train_file("t.csv", "target\n1\n"), "unsupported suffix '.csv'"),
    "json not a list": (train_file("t.json", '{"target": 1}'), "must hold a JSON list"),
    "integer past 4300 digits": (
        train_file("t.jsonl", '{"target": ' + "9" * 5000 + "}\n"),
        "line 1 of",
    ),
    "nested past the limit": (train_file("t.json", "[" * 100_000), "is not usable JSON"),
    "generator kwargs": (override("data.train.size=3"), "rejected kwargs ['n', 'size', 'target']"),
    # rewards
    "NaN reward": (workflow("nan_reward"), "reward must be a finite number"),
    "None reward": (workflow("none_reward"), "reward must be a number, got NoneType"),
    "string reward": (workflow("string_reward"), "reward must be a number, got str"),
    "huge reward": (workflow("huge_reward"), "reward must be within"),
    # workflow returns
    "returns a dict": (workflow("returns_a_dict"), "workflow returned dict"),
    "returns None": (workflow("returns_none"), "workflow returned NoneType"),
    "returns []": (workflow("returns_an_empty_list"), "workflow returned list"),
    "no steps": (workflow("returns_no_steps"), "a Trajectory with no steps"),
    "mismatched logprobs": (workflow("mismatched_logprobs"), "logprobs has 2 entries for 1"),
    # backend replies
    "metrics not a dict": (backend("ListForwardBackward"), "forward_backward returned list"),
    "metric not a number": (backend("StringMetric"), "metric values must be numbers"),
    "engine reply": (backend("DictEngineReply"), "not ModelOutput"),
}


def argv(tmp: Path, setup: Setup) -> list[str]:
    extra = setup(tmp)
    config = str(DEMO)
    if extra[:1] == ["--config"]:
        config, extra = extra[1], extra[2:]
    quiet = [f"logging.run_dir={tmp / 'runs'}", "logging.console=false"]
    return ["train", config, *quiet, "trainer.eval_before_train=false", *extra]


@pytest.mark.parametrize("row", sorted(ROWS))
def test_bad_input_is_one_line_exit_2_and_no_run_directory(
    row: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup, expected = ROWS[row]
    args = argv(tmp_path, setup)
    before = sorted((tmp_path / "runs").rglob("*")) if (tmp_path / "runs").exists() else []
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, f"{row}: exit {code}: {err}"
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, f"{row}: {err}"
    assert expected in err, f"{row}: expected {expected!r} in: {err}"
    after = sorted((tmp_path / "runs").rglob("*")) if (tmp_path / "runs").exists() else []
    assert after == before, f"{row}: the run directory changed: {after}"


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_a_renamed_key_is_refused_in_one_line_naming_the_new_key(old: str) -> None:
    section, key = old.split(".")
    with pytest.raises(ConfigError) as caught:
        load_config({"workflow": "unified.testing:BanditWorkflow", section: {key: 5}})
    expected = f"{old} was renamed {RENAMED_KEYS[old]}; write {RENAMED_KEYS[old]}=5"
    assert str(caught.value) == expected, str(caught.value)


def test_the_table_has_at_least_30_rows() -> None:
    assert len(ROWS) >= 30, len(ROWS)


@pytest.mark.parametrize("row", ["config file missing", "NaN reward", "metrics not a dict"])
def test_bad_input_in_a_real_process_exits_2_with_one_line(row: str, tmp_path: Path) -> None:
    setup, expected = ROWS[row]
    done = subprocess.run(
        [sys.executable, "-m", "unified.cli", *argv(tmp_path, setup)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and expected in done.stderr, done.stderr
    assert not (tmp_path / "runs" / RUN).exists(), "no run directory left behind"


def test_a_workflow_bug_keeps_its_traceback_under_a_one_line_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(argv(tmp_path, workflow("BuggyWorkflow")))
    err = capsys.readouterr().err
    first, *rest = err.strip().splitlines()
    assert code == 1, err
    assert first.startswith("unified: error: ZeroDivisionError: division by zero"), first
    assert "trainer.max_error_rate" in first and first.endswith("its traceback follows"), first
    trace = "\n".join(rest)
    assert trace.startswith("Traceback") and "in _score" in trace, "the user's frame is shown"
