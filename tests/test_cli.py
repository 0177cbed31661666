"""The `unified` command: bad input is one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from unified.checkpoint import RunDirectory
from unified.cli import main
from unified.errors import BackendError
from unified.testing import BanditBackend

DEMO = Path(__file__).with_name("demo.yaml")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def demo(tmp_path: Path) -> list[str]:
    """The demo config with its run directory under tmp_path and the console quiet."""
    return [str(DEMO), f"logging.run_dir={tmp_path / 'runs'}", "logging.console=false"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.bach_size=3", "unknown config key 'trainer.bach_size'; did you mean 'batch_"),
        ("trainer.zzz=3", "unknown config key 'trainer.zzz'; valid keys here: "),
        ("async.over_admit=1", "async.over_admit (1) applies only with async.strict_staleness"),
        ("trainer.decay_steps=2", "trainer.decay_steps (2) applies only with trainer.lr_sched"),
        (
            "trainer.lr_schedule=wsd trainer.warmup_steps=2 trainer.decay_steps=99",
            "trainer.warmup_steps (2) + trainer.decay_steps (99) exceed trainer.total_steps",
        ),
        ("trainer.batch_size=lots", "config key 'trainer.batch_size'"),
        ("async.max_staleness=-1", "greater than or equal to 0"),
        ("workflow=unified.testing:NoSuchWorkflow", "has no attribute 'NoSuchWorkflow'"),
        ("workflow=no_such_module:Flow", "cannot import module 'no_such_module'"),
        ("async.partial_rollout=true", "async.partial_rollout=True is not supported by backend"),
        ("trainer.tis_cap=2", "trainer.tis_cap=2.0 is not supported by backend 'bandit'"),
        ("trainer.tis_cap=0.5", "config key 'trainer.tis_cap': Value error, must be >= 1"),
        ("trainer.loss=nope", "config key 'trainer.loss'"),
        ("backend=quantum", "unknown backend 'quantum'"),
        ("data.train.n=0", "data.train is empty"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], demo: list[str], override: str, expected: str
) -> None:
    code, _, err = run(capsys, "train", *demo, *override.split())
    assert code == 2, err
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


class LosesItsWorkers(BanditBackend):
    """The bandit backend whose 15th optimizer step fails as a lost worker would."""

    steps = 0

    async def optim_step(self) -> dict[str, float]:
        self.steps += 1
        if self.steps == 15:
            raise BackendError("worker rank 1 of 2 was lost during train_step")
        return await super().optim_step()


def test_a_run_failing_after_a_checkpoint_names_it_and_resume_in_one_line(
    capsys: pytest.CaptureFixture[str], demo: list[str]
) -> None:
    code, _, err = run(capsys, "train", *demo, "backend=tests.test_cli:LosesItsWorkers")
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert "BackendError: worker rank 1 of 2 was lost during train_step; checkpoint " in err
    assert err.strip().endswith("step_000010; continue with resume=true"), err


def test_unknown_key_error_lists_the_valid_keys(
    capsys: pytest.CaptureFixture[str], demo: list[str]
) -> None:
    _, _, err = run(capsys, "train", *demo, "trainer.bach_size=3")
    assert "batch_size" in err and "group_size" in err


def test_empty_dataset_file_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], demo: list[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run(capsys, "train", *demo, f"data.train={empty}")
    assert code == 2 and "empty" in err, err


def test_dry_run_prints_the_resolved_config_and_the_checks(
    capsys: pytest.CaptureFixture[str], demo: list[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "train", *demo, "--dry-run", "trainer.batch_size=16")
    assert code == 0
    resolved = yaml.safe_load(out)
    assert resolved["trainer"]["batch_size"] == 16
    assert resolved["async"]["max_staleness"] == 1, "the async section keeps its public name"
    assert "checks passed" in out
    assert "truncated IS off" in out, "auto resolves to off on a backend without the capability"
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"


def test_dry_run_shows_the_backends_section_with_its_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = Path(__file__).parent.parent / "examples" / "countdown" / "local_sync.yaml"
    code, out, _ = run(capsys, "train", str(path), "--dry-run", "local.forward_batch_size=8")
    assert code == 0
    resolved = yaml.safe_load(out)
    assert resolved["local"]["forward_batch_size"] == 8, "the override"
    assert resolved["trainer"]["optimizer"]["max_grad_norm"] == 1.0
    assert resolved["local"]["kl_clamp"] is None
    assert "tinker" not in resolved and "verl" not in resolved, "other backends' empty sections"


@pytest.mark.parametrize(
    ("config", "override", "expected"),
    [
        ("local_sync", "local.foo=1", "config key 'local.foo'"),
        ("local_sync", "model=/no/such/model", "model directory '/no/such/model' does not exist"),
        ("local_sync", "model=builtin:huge", "unknown built-in model 'builtin:huge'"),
        ("tinker_sync", "tinker.lora_rank=0", "config key 'tinker.lora_rank'"),
        ("tinker_sync", "sampling.train.temperature=0.7", "sampling.train.temperature=0.7"),
        ("tinker_async", "trainer.micro_batch_size=1", "trainer.loss_agg token_mean averages"),
    ],
)
def test_dry_run_checks_the_backend_section_and_the_model(
    capsys: pytest.CaptureFixture[str], config: str, override: str, expected: str
) -> None:
    path = Path(__file__).parent.parent / "examples" / "countdown" / f"{config}.yaml"
    code, _, err = run(capsys, "train", str(path), "--dry-run", override)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err


def test_train_writes_config_metrics_and_ledger(
    capsys: pytest.CaptureFixture[str], demo: list[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "train", *demo, "trainer.total_steps=4")
    assert code == 0 and "trained 4 steps" in out
    run_dir = tmp_path / "runs" / "bandit-demo"
    for name in ("config.yaml", "metrics.jsonl", "ledger.jsonl"):
        assert (run_dir / name).is_file(), name
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_steps"] == 4


def test_a_resume_over_other_tasks_or_another_seed_is_refused_and_changes_nothing(
    capsys: pytest.CaptureFixture[str], demo: list[str], tmp_path: Path
) -> None:
    """Another seed or dataset orders the tasks differently: the checkpoint's position in it
    would train some tasks twice and skip others."""
    assert run(capsys, "train", *demo, "trainer.total_steps=10")[0] == 0
    run_dir = tmp_path / "runs" / "bandit-demo"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    for change, expected in (
        ("trainer.seed=1", "was trained with trainer.seed=0"),
        ("data.train.n=40", "the train tasks or trainer.seed differ"),
    ):
        code, _, err = run(capsys, "train", *demo, "trainer.total_steps=20", "resume=true", change)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after == before, "refused before config.yaml, the ledger or the metrics changed"
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000010"]


def test_a_resumed_run_says_where_it_continued_from(
    capsys: pytest.CaptureFixture[str], demo: list[str]
) -> None:
    assert run(capsys, "train", *demo, "trainer.total_steps=10")[0] == 0
    code, out, err = run(capsys, "train", *demo, "trainer.total_steps=14", "resume=true")
    assert code == 0 and "trained 14 steps (resumed at step 10)" in out, err


def test_console_script_exits_2_on_a_bad_key(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("unified")
    proc = subprocess.run(
        [str(script), "train", str(DEMO), "nope.key=1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=DEMO.parent.parent,
    )
    assert proc.returncode == 2 and "unknown config key 'nope'" in proc.stderr, proc.stderr


def test_eval_scores_a_checkpoint_as_the_run_did(
    capsys: pytest.CaptureFixture[str], demo: list[str], tmp_path: Path
) -> None:
    assert run(capsys, "train", *demo, "trainer.total_steps=20")[0] == 0
    run_dir = tmp_path / "runs" / "bandit-demo"
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in logged if "eval/accuracy" in r}
    assert set(evals) >= {0, 20} and evals[0] != evals[20], evals

    out_file = tmp_path / "eval.json"
    code, out, err = run(
        capsys, "eval", *demo, "--checkpoint", str(run_dir), "--json", str(out_file)
    )
    assert code == 0, err
    assert json.loads(out) == json.loads(out_file.read_text())
    assert json.loads(out)["eval/accuracy"] == evals[20], "the newest checkpoint, scored the same"
    assert json.loads(out)["eval/step"] == 20
    assert f"scored the policy of {run_dir} at step 20" in err

    code, out, err = run(capsys, "eval", *demo)
    assert code == 0, err
    assert json.loads(out)["eval/accuracy"] == evals[0], "without a checkpoint: config.model"
    assert json.loads(out)["eval/step"] == 0 and "(step 0)" in err


def test_find_checkpoint_takes_the_newest_complete_one(tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("step_000010", "step_000020", ".tmp-step_000030"):
        (checkpoints / name).mkdir(parents=True)
    for name in ("step_000010", "step_000020"):
        state = {"step": int(name[5:]), "version": 0, "next_seq": 0, "sampler": {}}
        (checkpoints / name / "trainer_state.json").write_text(json.dumps(state))
    newest = checkpoints / "step_000020"
    assert RunDirectory.find_checkpoint(tmp_path / "run") == newest
    assert RunDirectory.find_checkpoint(checkpoints / "step_000010") == checkpoints / "step_000010"


def test_eval_refuses_a_checkpoint_of_another_backend(
    capsys: pytest.CaptureFixture[str], demo: list[str], tmp_path: Path
) -> None:
    assert run(capsys, "train", *demo, "trainer.total_steps=10")[0] == 0
    run_dir = tmp_path / "runs" / "bandit-demo"
    code, _, err = run(capsys, "eval", *demo, "backend=local", "--checkpoint", str(run_dir))
    assert code == 2 and "was trained with backend='unified.testing:BanditBackend'" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--checkpoint", "no/such/run"], "is neither a checkpoint"),
        (["data.eval=null"], "unified eval needs eval tasks"),
        (["--json", "no/such/folder/eval.json"], "its folder does not exist"),
        (["--json", "."], "is a folder; give a file path"),
    ],
)
def test_eval_bad_input_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], demo: list[str], extra: list[str], expected: str
) -> None:
    code, _, err = run(capsys, "eval", *demo, *extra)
    assert code == 2 and expected in err, err
    assert len(err.strip().splitlines()) == 1
