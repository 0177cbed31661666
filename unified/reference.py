"""The backend sections' key tables in docs/, generated from each backend's `section_model`.

A doc holds a backend's table between two markers (`<!-- backend-section local ... -->` and
`<!-- end backend-section local -->`); the table between them is what `schema_tables` makes of
the section model of the backend registered under that name, so it is never written twice.
`python -m unified.reference [docs]` rewrites every marked table; `tests/test_docs.py` checks that
none differs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from unified.config import schema_tables
from unified.protocol import backend_class

__all__ = ["backend_section_markdown", "fill_backend_sections", "main", "marked_backends"]

_MARKED = re.compile(
    r"(?P<begin><!-- backend-section (?P<name>[\w-]+)\b[^\n]*-->\n)"
    r"(?P<table>.*?)"
    r"(?P<end><!-- end backend-section (?P=name) -->)",
    re.DOTALL,
)


def backend_section_markdown(name: str) -> str:
    """The key table of backend `name`'s own section (`<name>:`), from its `section_model`."""
    model = getattr(backend_class(name), "section_model", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ValueError(f"backend {name!r} has no section_model to document")
    return "\n".join(schema_tables(model, f"{name}.")) + "\n"


def fill_backend_sections(text: str) -> str:
    """`text` with every marked backend table regenerated."""

    def table(marked: re.Match[str]) -> str:
        # Blank lines around the table: the markers are HTML blocks of their own.
        return f"{marked['begin']}\n{backend_section_markdown(marked['name'])}\n{marked['end']}"

    return _MARKED.sub(table, text)


def marked_backends(text: str) -> list[str]:
    """The backends whose tables `text` marks."""
    return [m["name"] for m in _MARKED.finditer(text)]


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the marked backend tables of every Markdown file under a folder (`docs`)."""
    args = sys.argv[1:] if argv is None else list(argv)
    docs = Path(args[0] if args else "docs")
    for path in sorted(docs.rglob("*.md")):
        text = path.read_text()
        filled = fill_backend_sections(text)
        if filled != text:
            path.write_text(filled)
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
