"""Resolve `module.path:name` strings (workflows, backends, data generators) to objects."""

from __future__ import annotations

import importlib
from typing import Any

from unified.errors import UsageError

__all__ = ["import_object"]


def import_object(path: str, *, what: str) -> Any:
    """Import `module.path:attr` (or `module.path.attr`); a failure names `what` and the path."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UsageError(f"{what} {path!r} must be an import path like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError) as e:  # TypeError: a relative name ('.mod')
        raise UsageError(f"{what} {path!r}: cannot import module {module_name!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(
                f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj
