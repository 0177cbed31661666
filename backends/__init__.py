"""Training backends, registered by name.

The core (`unified/`) never imports this package: it finds backends through the entry point
group `unified.backends` declared in pyproject.toml, so a backend's heavy dependencies (torch,
tinker, verl, ray) load only when a run selects it. Third-party backends register the same way,
or are named by import path in the config (`backend: my_pkg.backend:MyBackend`).
"""

from __future__ import annotations

from importlib.metadata import entry_points

__all__ = ["registered_backends"]


def registered_backends() -> dict[str, str]:
    """Registered backend names and the `module:Class` each one loads."""
    return {ep.name: ep.value for ep in entry_points(group="unified.backends")}
