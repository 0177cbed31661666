"""Docs that are generated or copied stay true: the config reference, the backend tables, the
tinker-serve compatibility table and the CI command."""

from __future__ import annotations

import re
from pathlib import Path

from tinker_server.compat import fill_compat_table
from unified.config import reference_markdown
from unified.reference import fill_backend_sections, marked_backends

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_generated_from_the_schema() -> None:
    written = (ROOT / "docs" / "configuration.md").read_text()
    assert written == reference_markdown(), "regenerate docs/configuration.md (see its header)"


def test_backend_section_tables_are_generated_from_their_models() -> None:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    marked = {name for path in docs for name in marked_backends(path.read_text())}
    assert {"local", "tinker", "verl"} <= marked, f"each backend's table is marked; got {marked}"
    for path in docs:
        text = path.read_text()
        assert text == fill_backend_sections(text), (
            f"regenerate the tables of {path.relative_to(ROOT)}: python -m unified.reference"
        )


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in commands, f".ci/run must run the README's test command, got {ci!r}"


def test_the_tinker_compatibility_table_is_the_generated_one() -> None:
    doc = (ROOT / "docs" / "backends" / "tinker.md").read_text()
    assert "<!-- tinker-compat -->" in doc, "docs/backends/tinker.md lost its table's markers"
    assert doc == fill_compat_table(doc), (
        "regenerate the table of docs/backends/tinker.md: python -m tinker_server.compat"
    )
