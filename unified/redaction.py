"""Secrets stay secret: API keys never reach logs, `config.yaml`, metrics, checkpoints or errors.

Keys come from the environment only (`TINKER_API_KEY`, `WANDB_API_KEY`, ...), never from a config
file. `redact(text)` replaces every secret value it knows with `***`: the values of environment
variables whose name says key, token, secret or password, and values a backend `register`s (a key
read from a variable of another name). `redact_config` also masks config entries whose key names
a secret. The run's `config.yaml`, the W&B run config, the CLI's error lines and tracebacks, and
the log handler the CLI installs all pass through here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "RedactingHandler", "redact", "redact_config", "register"]

MASK = "***"
_SECRET_ENV = re.compile(r"API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
_SECRET_KEY = re.compile(
    r"(^|[_-])(api[_-]?keys?|(access|private)[_-]?keys?|secret([_-]access)?([_-]?keys?)?|secrets"
    r"|token|password|passwd|credentials?|authorization)$",
    re.IGNORECASE,
)
# A tokenizer's special tokens are not secrets.
_TOKENIZER_TOKEN = re.compile(r"(^|_)(pad|eos|bos|unk|sep|cls|mask)_token$", re.IGNORECASE)
_MIN_LENGTH = 8  # shorter values ("true", "1") would mask ordinary words
_registered: set[str] = set()


def register(value: str | None) -> None:
    """Treat `value` as a secret from now on (a key read from a custom environment variable)."""
    if value and len(value) >= _MIN_LENGTH:
        _registered.add(value)


def _secret_values() -> list[str]:
    found = set(_registered)
    for name, value in os.environ.items():
        if _SECRET_ENV.search(name) and len(value) >= _MIN_LENGTH:
            found.add(value)
    # Longest first, so a key that contains another is masked whole.
    return sorted(found, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every known secret value replaced by `***`."""
    for value in _secret_values():
        if value in text:
            text = text.replace(value, MASK)
    return text


def redact_config(data: Any) -> Any:
    """A copy of a config's plain data with secrets masked: values under keys that name a
    secret (`api_key`, `token`, `password`, ...) and known secret values anywhere."""
    if isinstance(data, Mapping):
        return {
            k: MASK if _names_a_secret(str(k)) and v not in (None, "") else redact_config(v)
            for k, v in data.items()
        }
    if isinstance(data, list | tuple):
        return [redact_config(v) for v in data]
    if isinstance(data, str):
        return redact(data)
    return data


class RedactingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes log records to the current `sys.stderr` with secrets masked, tracebacks included."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # the stream of now: the CLI runs in-process in tests
        super().emit(record)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def _names_a_secret(key: str) -> bool:
    return bool(_SECRET_KEY.search(key)) and not _TOKENIZER_TOKEN.search(key)
