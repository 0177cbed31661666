"""Model providers for tests: a tiny model directory built on first call, and broken providers.

`tiny_model` writes a marker file into `$UNIFIED_TEST_MODEL_DIR` and counts its builds, so a
test can check the directory was built once and handed to the backend.
"""

from __future__ import annotations

import os
from pathlib import Path

builds = 0


def tiny_model() -> Path:
    """Build (once) and return the directory named by $UNIFIED_TEST_MODEL_DIR."""
    global builds
    directory = Path(os.environ["UNIFIED_TEST_MODEL_DIR"])
    if not (directory / "config.json").is_file():
        builds += 1
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")
    return directory


def tiny_policy() -> Path:
    """The built-in tiny policy saved into $UNIFIED_TEST_MODEL_DIR (a loadable model directory)."""
    from torchkit.builtin import load_policy, save_policy

    directory = Path(os.environ["UNIFIED_TEST_MODEL_DIR"])
    if not (directory / "config.json").is_file():
        save_policy(*load_policy("builtin:tiny"), directory)
    return directory


def broken_model() -> Path:
    """A provider whose build fails."""
    raise RuntimeError("the warm start needs 3 numbers, got 2")


def missing_model() -> str:
    """A provider that returns a directory it never made."""
    return "/no/such/model/dir"


not_a_function = "a string, not a provider"
