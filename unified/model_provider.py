"""Model providers: `model: module:function` names code that builds the run's model directory.

`model:` is a built-in name (`builtin:tiny`), a local Hugging Face directory, a service's model
name, or an import path `package.module:function` naming a *model provider*: a function called
with no arguments that returns a local model directory, building it on first use and caching it
(the countdown example's warm start). It is resolved once, before the backend loads the model,
by everything that loads one (`UnifiedTrainer`, `unified sft`, `unified eval`, `unified
tinker-serve`), so the backend only ever sees a directory. The core imports a provider only by
the string the config names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from unified.config import TrainerConfig
from unified.errors import UsageError
from unified.imports import import_object

__all__ = ["is_model_provider", "model_provider", "resolve_model", "resolve_model_spec"]

# `package.module:function`; `builtin:` names and paths (`/`, `\`, a drive) never match.
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_BUILTIN_PREFIX = "builtin:"


def is_model_provider(model: str) -> bool:
    """Whether `model` names a provider rather than a built-in, a directory or a model name."""
    if model.startswith(_BUILTIN_PREFIX) or not _IMPORT_PATH.match(model):
        return False
    return not Path(model).exists()


def model_provider(model: str) -> Callable[[], object] | None:
    """The provider function `model` names (imported, not called), or None for a plain model."""
    if not is_model_provider(model):
        return None
    provider = import_object(model, what="model provider")
    if not callable(provider):
        raise UsageError(
            f"model provider {model!r} is a {type(provider).__name__}, not a function; "
            "name a function that returns a model directory"
        )
    return provider  # type: ignore[no-any-return]


def resolve_model(config: TrainerConfig) -> TrainerConfig:
    """`config` with a provider in `model` replaced by the directory it returns (may build it).

    Blocking (a provider may train a model on first use): call it off the event loop.
    """
    model = resolve_model_spec(config.model)
    if model == config.model:
        return config
    resolved = config.model_copy(deep=True)
    resolved.model = model
    return resolved


def resolve_model_spec(model: str) -> str:
    """`model` itself, or the directory the provider it names returns (may build it; blocking)."""
    provider = model_provider(model)
    if provider is None:
        return model
    try:
        directory = provider()
    except Exception as e:
        raise UsageError(f"model provider {model!r} failed: {e!r}") from e
    if not isinstance(directory, str | Path) or not Path(directory).is_dir():
        raise UsageError(
            f"model provider {model!r} returned {directory!r}, not an existing model "
            "directory; it must build the directory and return its path"
        )
    return str(directory)
