"""The core's layers: importing a type loads no trainer, and no module of `unified/` imports one
that imports it back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import unified

UNIFIED = Path(__file__).resolve().parent.parent / "unified"


def test_importing_the_types_loads_neither_the_loop_nor_the_trainer() -> None:
    script = (
        "import sys, unified.types, unified.protocol; "
        "print(sorted(m for m in ('unified.loop', 'unified.trainer') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"a type import loaded {done.stdout.strip()}"


def test_every_public_name_of_the_package_resolves() -> None:
    missing = [name for name in unified.__all__ if getattr(unified, name, None) is None]
    assert not missing, f"unified.__all__ names what it cannot give: {missing}"
    for name in ("UnifiedTrainer", "SyncCoordinator", "TrajectoryGroupBuffer", "MetricsAggregator"):
        assert name in unified.__all__, f"{name} is one of the package's public names"


def _imports(path: Path) -> set[str]:
    """The `unified.*` modules `path` imports, at run time (not under `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("unified.")}


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (depth first, each module entered once), or []."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done or module not in graph:
            return []
        for imported in sorted(graph[module]):
            if cycle := visit(imported, [*path, module]):
                return cycle
        done.add(module)
        return []

    return next((cycle for module in sorted(graph) if (cycle := visit(module, []))), [])


def test_no_module_of_the_core_imports_one_that_imports_it_back() -> None:
    graph = {f"unified.{p.stem}": _imports(p) for p in UNIFIED.glob("*.py")}
    cycle = _a_cycle(graph)
    assert not cycle, f"an import cycle in unified/: {' -> '.join(cycle)}"
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"], "the finder"
