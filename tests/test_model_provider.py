"""`model: module:function` model providers: built once before the backend loads the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests import model_providers
from tests.conftest import ConfigFactory
from unified.cli import main
from unified.model_provider import is_model_provider
from unified.testing import BanditBackend, bandit_tasks
from unified.trainer import UnifiedTrainer

DEMO = Path(__file__).with_name("demo.yaml")


def cli_args(command: str, run_dir: Path, provider: str) -> list[str]:
    """`unified <command>` on the demo config with `model` naming a provider in tests/."""
    return [
        command,
        str(DEMO),
        f"logging.run_dir={run_dir}",
        "logging.console=false",
        f"model=tests.model_providers:{provider}",
    ]


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where `tests.model_providers:tiny_model` builds, with its build counter at zero."""
    directory = tmp_path / "built-model"
    monkeypatch.setenv("UNIFIED_TEST_MODEL_DIR", str(directory))
    monkeypatch.setattr(model_providers, "builds", 0)
    return directory


@pytest.mark.parametrize(
    ("model", "provider"),
    [
        ("examples.countdown.prepare:warmstart_model", True),
        ("tests.model_providers:tiny_model", True),
        ("builtin:tiny", False),
        ("Qwen/Qwen3-8B", False),
        (".cache/countdown-warmstart-tiny", False),
        ("C:\\models\\tiny", False),
    ],
)
def test_only_an_import_path_names_a_model_provider(model: str, provider: bool) -> None:
    assert is_model_provider(model) is provider, model


def test_an_existing_directory_is_a_directory_even_if_it_looks_like_an_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models:tiny").mkdir()
    assert not is_model_provider("models:tiny")


def test_the_backend_loads_the_directory_the_provider_builds_once(
    make_config: ConfigFactory, model_dir: Path
) -> None:
    config = make_config(model="tests.model_providers:tiny_model")
    backends = [BanditBackend(), BanditBackend()]
    for i, backend in enumerate(backends):
        trainer = UnifiedTrainer(
            {**config, "name": f"run{i}"}, backend=backend, train_tasks=bandit_tasks(8)
        )
        result = trainer.fit()
        recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())["model"]
        assert recorded == str(model_dir), "the run records the directory it trained from"
    assert [b.model for b in backends] == [str(model_dir)] * 2, "setup saw the directory"
    assert model_providers.builds == 1, "the second run reuses the cached directory"


def test_a_dry_run_imports_the_provider_but_builds_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path
) -> None:
    code = main([*cli_args("train", tmp_path, "tiny_model"), "--dry-run"])
    assert code == 0, capsys.readouterr().err
    assert model_providers.builds == 0 and not model_dir.exists()


def test_eval_resolves_the_provider_too(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path
) -> None:
    code = main(cli_args("eval", tmp_path, "tiny_model"))
    assert code == 0, capsys.readouterr().err
    assert model_providers.builds == 1 and (model_dir / "config.json").is_file()


@pytest.mark.parametrize(
    ("provider", "expected"),
    [
        ("broken_model", "failed: RuntimeError('the warm start needs 3 numbers, got 2')"),
        ("missing_model", "returned '/no/such/model/dir', not an existing model directory"),
        ("not_a_function", "is a str, not a function"),
        ("no_such_provider", "has no attribute 'no_such_provider'"),
    ],
)
def test_a_failing_provider_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, provider: str, expected: str
) -> None:
    code = main(cli_args("train", tmp_path, provider))
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"model provider 'tests.model_providers:{provider}'" in err and expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
