"""Secrets stay secret: a planted API key appears in no file of the run and in no output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from unified.cli import main
from unified.config import load_config
from unified.redaction import MASK, redact, redact_config, register

KEY = "tml-PLANTED-0123456789abcdef"
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
DEMO = Path(__file__).with_name("demo.yaml")


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_KEY)


def leaks(root: Path, *outputs: str) -> list[str]:
    """Files under `root` and outputs holding either planted key."""
    found = [str(p) for p in root.rglob("*") if p.is_file() and _holds_key(p.read_bytes())]
    return found + [f"output {i}" for i, text in enumerate(outputs) if _holds_key(text.encode())]


def _holds_key(data: bytes) -> bool:
    return KEY.encode() in data or WANDB_KEY.encode() in data


def train_argv(tmp_path: Path, workflow: str) -> list[str]:
    return [
        "train",
        str(DEMO),
        f"logging.run_dir={tmp_path / 'runs'}",
        f"workflow=tests.faulty:{workflow}",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        f"verl.api_key={KEY}",  # a key written into a config file by mistake
        f"local.note=the key is {WANDB_KEY}",
    ]


@pytest.mark.usefixtures("planted")
@pytest.mark.parametrize(("workflow", "code"), [("LeakyWorkflow", 0), ("LeakyFailingWorkflow", 1)])
def test_a_planted_key_is_in_no_file_of_the_run_and_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workflow: str, code: int
) -> None:
    assert main(train_argv(tmp_path, workflow)) == code
    out, err = capsys.readouterr()
    written = (tmp_path / "runs" / "bandit-demo" / "config.yaml").is_file()
    # A run failing before its first step leaves no directory: then only the output can leak.
    assert written == (code == 0), "the run was written if and only if it trained"
    assert leaks(tmp_path / "runs", out, err) == [], "the key leaked"
    if code:
        assert f"tool refused key {MASK}" in err and "Traceback" in err, err


@pytest.mark.usefixtures("planted")
def test_logs_of_a_real_process_mask_the_key(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "unified.cli", *train_argv(tmp_path, "LeakyWorkflow")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"calling the tool with key {MASK}" in done.stderr, done.stderr
    assert leaks(tmp_path / "runs", done.stdout, done.stderr) == []


@pytest.mark.usefixtures("planted")
def test_config_yaml_masks_secret_keys_and_values_but_keeps_the_rest() -> None:
    config = load_config(
        {
            "workflow": "unified.testing:BanditWorkflow",
            "tinker": {"base_url": f"https://user:{KEY}@example.com", "api_key_env": "X"},
            "verl": {"token": "hf_abcdefghijkl", "password": "", "max_tokens": 64},
        }
    )
    public = config.public_dump()
    assert public["tinker"]["base_url"] == f"https://user:{MASK}@example.com"
    assert public["tinker"]["api_key_env"] == "X", "the variable's name is no secret"
    assert public["verl"] == {"token": MASK, "password": "", "max_tokens": 64}
    assert KEY not in config.to_yaml()


def test_a_registered_value_is_masked_whatever_its_variable(monkeypatch: Any) -> None:
    register("custom-secret-value-42")
    assert redact("failed with custom-secret-value-42!") == f"failed with {MASK}!"
    assert redact_config({"note": "x custom-secret-value-42"}) == {"note": f"x {MASK}"}
    register("short")
    assert redact("a short word") == "a short word", "short values are never masked"


@pytest.mark.parametrize(
    "key",
    ["api_key", "aws_secret_access_key", "private_key", "x-api-key", "Authorization", "api_keys",
     "hf_token", "client_secret", "password", "secret_key"],
)  # fmt: skip
def test_config_entries_named_as_secrets_are_masked(key: str) -> None:
    assert redact_config({"local": {key: "sk-live-abcdef123456"}}) == {"local": {key: MASK}}


@pytest.mark.parametrize("key", ["pad_token", "eos_token", "max_tokens", "tokens", "api_key_env"])
def test_tokenizer_tokens_and_token_counts_are_not_secrets(key: str) -> None:
    assert redact_config({key: "<|endoftext|>"}) == {key: "<|endoftext|>"}
