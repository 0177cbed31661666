"""Docs that are generated or copied stay true: the config reference and the CI command."""

from __future__ import annotations

import re
from pathlib import Path

from unified.config import reference_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_generated_from_the_schema() -> None:
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == reference_markdown(), "regenerate docs/configuration.md (see its header)"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in commands, f".ci/run must run the README's test command, got {ci!r}"
