"""The layers hold: read from the source with `ast`, so no import has to run.

- `unified/` (the core) imports no backend, nor the torch kit, nor the Tinker-compatible server:
  it finds backends and contributed commands through entry points.
- No module under `backends/<x>/` imports `backends.<y>`: what backends share lives in the torch
  kit (`torchkit/`).
- `torchkit/` imports only `unified` (and torch, transformers, ...); `tinker_server/` imports
  `unified` and `torchkit`; neither imports `backends`. `gateway/` imports `unified` and
  `workflows` (the tool-call format) only.
- Every entry point in pyproject.toml names a module of this checkout that defines it.
- Importing a type loads no trainer (`unified/__init__.py` is lazy), and no module of `unified/`
  imports one that imports it back.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import unified

ROOT = Path(__file__).resolve().parent.parent
UNIFIED = ROOT / "unified"
# The project's own top-level packages (anything else imported is a third-party library).
PROJECT = frozenset(
    {
        "unified",
        "backends",
        "torchkit",
        "tinker_server",
        "gateway",
        "workflows",
        "examples",
        "tests",
        "bench",
    }
)


def module_name(path: Path) -> str:
    """The dotted name `path` is imported as."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every module name `source` (the module `module`) imports, function bodies included; for
    `from a import b` both `a` and `a.b` (b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    return imported(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def outermost(names: set[str]) -> list[str]:
    """`names` without `a.b` where `a` is there too: one line per offending statement."""
    return sorted(name for name in names if name.rpartition(".")[0] not in names)


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def project_imports(path: Path) -> set[str]:
    """The project's own modules that `path` imports."""
    return {name for name in imports_of(path) if name.split(".")[0] in PROJECT}


def test_the_import_reader_sees_nested_and_relative_imports() -> None:
    source = (
        "import os\n"
        "from . import sibling\n"
        "from ..other import thing\n"
        "def f():\n"
        "    from backends.local.backend import LocalBackend\n"
    )
    found = imported(source, "pkg.sub.mod")
    assert {"os", "pkg.sub.sibling", "pkg.other", "backends.local.backend"} <= found
    assert "backends.local" in imported("from backends import local\n", "backends.tinker.x")


def test_no_backend_imports_another_backend() -> None:
    folder = ROOT / "backends"
    backends = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    assert {"local", "tinker", "verl"} <= backends
    leaks = []
    for path in sources("backends"):
        parts = path.relative_to(folder).parts
        own = parts[0] if len(parts) > 1 else None
        found = set()
        for name in imports_of(path):
            head = name.split(".")
            if head[0] == "backends" and len(head) > 1 and head[1] in backends - {own}:
                found.add(name)
        leaks += [f"{path.relative_to(ROOT)} imports {name}" for name in outermost(found)]
    assert not leaks, "a backend imports another; share it through torchkit/:\n" + "\n".join(leaks)


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("torchkit", {"unified", "torchkit"}),
        ("tinker_server", {"unified", "torchkit", "tinker_server"}),
        # The gateway serves any backend's engine: it knows the core and the tool-call format.
        ("gateway", {"unified", "gateway", "workflows"}),
        # The core finds backends and contributed commands through entry points.
        (
            "unified",
            PROJECT - {"backends", "torchkit", "tinker_server", "gateway", "tests", "bench"},
        ),
    ],
)
def test_a_package_imports_only_the_layers_below_it(package: str, allowed: set[str]) -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(package)
        for name in outermost({n for n in project_imports(path) if n.split(".")[0] not in allowed})
    ]
    assert sources(package) and not found, "\n".join(found)


def _bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds (definitions, assignments, imports)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {t.id for t in targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {alias.asname or alias.name for alias in node.names}
    return set()


def _defines(path: Path, name: str) -> bool:
    """Whether the module at `path` binds `name` at its top level."""
    return any(name in _bound(node) for node in ast.parse(path.read_text()).body)


def test_every_entry_point_names_a_module_of_this_checkout_that_defines_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = dict(project.get("scripts", {}))
    for group, entries in project.get("entry-points", {}).items():
        targets |= {f"{group}:{name}": value for name, value in entries.items()}
    assert targets["unified.commands:tinker-serve"] == "tinker_server.server:main"
    missing = []
    for name, value in targets.items():
        module, _, attribute = value.partition(":")
        base = ROOT.joinpath(*module.split("."))
        path = base.with_suffix(".py")
        if not path.is_file():
            path = base / "__init__.py"
        if not (path.is_file() and _defines(path, attribute)):
            missing.append(f"{name} = {value}")
    assert not missing, "entry points naming nothing: " + ", ".join(missing)


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
