"""Shared fixtures: every test runs offline, in a temporary run directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchkit.builtin import load_policy, save_policy

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TINKER_TELEMETRY"] = "0"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

ConfigFactory = Callable[..., dict[str, Any]]


@pytest.fixture
def make_config(tmp_path: Path) -> ConfigFactory:
    """A config dict for the bandit backend; keyword sections are merged over the defaults."""

    def make(**sections: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "name": "test",
            "mode": "sync",
            "workflow": "unified.testing:BanditWorkflow",
            "trainer": {
                "total_steps": 4,
                "batch_size": 2,
                "group_size": 4,
                "lr": 0.5,
                "eval_every": 0,
                "eval_before_train": False,
                "save_every": 0,
                "stall_timeout_s": 30,
                "workflow_timeout_s": 10,
            },
            "async": {"max_staleness": 1, "sync_every": 1},
            "logging": {"run_dir": str(tmp_path / "runs"), "console": False},
        }
        for key, value in sections.items():
            key = "async" if key == "async_" else key
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        return config

    return make


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Any, Path]:
    """The built-in tiny model, its tokenizer, and both saved as a model directory (what an
    engine such as vLLM loads); once per test module."""
    model, tokenizer = load_policy("builtin:tiny")
    directory = tmp_path_factory.mktemp("policy") / "tiny"
    save_policy(model, tokenizer, directory)
    return model, tokenizer, directory
