"""`unified plot` draws a run's curves; `unified sft` fine-tunes and exports a loadable model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchkit.builtin import load_policy
from unified.cli import main
from unified.errors import UsageError
from unified.plot import panels, plot_run


def test_plot_writes_a_png_of_the_run_curves(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "reward/mean": 0.2, "train/entropy": 1.5, "train/kl_sample_train": 0.01},
        {"step": 2, "reward/mean": 0.3, "eval/accuracy": 0.2, "train/entropy": 1.4},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_run(tmp_path)
    assert path == tmp_path / "curves.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_directory_without_metrics_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"no metrics\.jsonl"):
        plot_run(tmp_path)


def test_plot_of_a_live_run_skips_the_line_being_written(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.2}\n{"step": 2, "rew')
    assert plot_run(tmp_path).is_file()
    with pytest.raises(UsageError, match="its folder does not exist"):
        plot_run(tmp_path, tmp_path / "missing" / "curves.png")
    (tmp_path / "plots").mkdir()
    with pytest.raises(UsageError, match=r"is a folder; give a \.png path in it"):
        plot_run(tmp_path, tmp_path / "plots")
    assert not list(tmp_path.glob(".*.tmp.png")), "no staged file is left behind"


def test_sft_command_trains_and_writes_a_loadable_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "chat.jsonl"
    example = {
        "messages": [{"role": "user", "content": "1 2"}, {"role": "assistant", "content": "1+2"}]
    }
    data.write_text("".join(json.dumps({"id": f"e{i}", **example}) + "\n" for i in range(8)))
    config = tmp_path / "sft.yaml"
    config.write_text(
        "name: sft\nbackend: local\nworkflow: examples.countdown.workflow:CountdownWorkflow\n"
        f"model: builtin:tiny\ndata: {{train: {data}}}\n"
        "trainer: {total_steps: 3, batch_size: 4, lr: 0.003}\n"
        f"logging: {{run_dir: {tmp_path / 'runs'}, console: false}}\n"
    )
    assert main(["sft", str(config)]) == 0, capsys.readouterr().err
    out = tmp_path / "runs" / "sft" / "model"
    model, tokenizer = load_policy(str(out))
    assert model.config.model_type == "qwen2"
    assert tokenizer.decode(tokenizer.encode("1+2")) == "1+2"
    lines = (tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and "train/loss" in json.loads(lines[-1])
    assert main(["sft", str(config)]) == 2, "a second run under the same name"
    assert "already holds a run" in capsys.readouterr().err
    assert len((tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()) == 3
    kept = sorted((tmp_path / "runs" / "sft").iterdir())
    other = ["name=sft2", "--output", str(tmp_path / "runs" / "sft")]
    assert main(["sft", str(config), *other]) == 2, "--output over another run's folder"
    assert "is not a model directory" in capsys.readouterr().err
    assert sorted((tmp_path / "runs" / "sft").iterdir()) == kept, "nothing was replaced"


def test_a_failed_sft_leaves_nothing_that_blocks_the_retry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"id": "e0", "messages": [{"role": "user", "content": "x"}]}) + "\n")
    config = tmp_path / "sft.yaml"
    config.write_text(
        "name: sft\nbackend: local\nworkflow: examples.countdown.workflow:CountdownWorkflow\n"
        f"model: builtin:tiny\ndata: {{train: {data}}}\n"
        "trainer: {total_steps: 1, batch_size: 1}\n"
        f"logging: {{run_dir: {tmp_path / 'runs'}, console: false}}\n"
    )
    assert main(["sft", str(config)]) == 2
    assert "with at least one message before the assistant reply" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "sft").exists()
    reply = {"role": "assistant", "content": "y"}
    data.write_text(json.dumps({"id": "e0", "messages": [{"role": "user", "content": "x"}, reply]}))
    assert main(["sft", str(config)]) == 0, capsys.readouterr().err


def test_sft_on_a_backend_that_cannot_export_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sft.yaml"
    config.write_text(
        "name: sft\nbackend: unified.testing:BanditBackend\n"
        "workflow: unified.testing:BanditWorkflow\n"
        f"logging: {{run_dir: {tmp_path / 'runs'}, console: false}}\n"
    )
    assert main(["sft", str(config)]) == 2
    assert "cannot do; fine-tune with backend=local or backend=verl" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "nothing trained, nothing written"


def test_the_kl_panel_shows_the_kl_to_the_reference_when_the_run_has_one() -> None:
    mismatch = [{"step": 1, "train/kl_sample_train": -0.001}]
    with_reference = [{"step": 1, "train/kl_sample_train": -0.001, "train/kl_reference": 0.2}]
    assert panels(mismatch)[3][0] == "train/kl_sample_train"
    assert panels(with_reference)[3][0] == "train/kl_reference"
    assert [key for key, _ in panels(with_reference)[:3]] == [
        "reward/mean",
        "eval/accuracy",
        "train/entropy",
    ]
