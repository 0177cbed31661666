"""Exported weights (`save_weights_external`): a Hugging Face model directory, or its files
encrypted to `age` recipients.

The export is the base model with the adapters merged in, and the tokenizer: `from_pretrained`
and `model: <dir>` load it. With `age_encryption_recipients` (x25519 `age1...` keys; what
tinker-cookbook's `weights.download` sends for a `tinker://.../weights/...` path) every file is
written as `<file>.age`, encrypted to all of them, and nothing unencrypted is left in the store.
Invariant: the directory is complete before the call returns, or absent.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tinker_server.training import UserError

__all__ = ["age_recipients", "write_export"]

AGE_SUFFIX = ".age"


def age_recipients(values: Any) -> list[Any]:
    """The `age` recipients an export is encrypted to (none: unencrypted), checked here so a bad
    key is one line to the client, not a half-written export."""
    if not values:
        return []
    try:
        import pyrage
    except ImportError:
        raise UserError(
            "age_encryption_recipients: this server cannot encrypt (pip install pyrage, the "
            "[tinker] extra has it)"
        ) from None
    recipients = []
    for value in values:
        try:
            recipients.append(pyrage.x25519.Recipient.from_str(str(value)))
        except pyrage.RecipientError as e:
            raise UserError(
                f"age_encryption_recipients: {value!r} is not an age x25519 recipient "
                f"(age1...): {e}"
            ) from None
    return recipients


def write_export(
    template: PreTrainedModel,
    weights: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    recipients: list[Any],
) -> None:
    """Write `weights` (on `template`'s architecture) and `tokenizer` to `directory`, each file
    encrypted to `recipients` when there are any (blocking)."""
    plain = directory if not recipients else directory.with_name(f".{directory.name}.plain")
    try:
        exported = copy.deepcopy(template)
        exported.load_state_dict(weights)
        exported.save_pretrained(plain, safe_serialization=True)
        tokenizer.save_pretrained(plain)
        if recipients:
            import pyrage

            for file in sorted(f for f in plain.rglob("*") if f.is_file()):
                target = directory / f"{file.relative_to(plain).as_posix()}{AGE_SUFFIX}"
                target.parent.mkdir(parents=True, exist_ok=True)
                pyrage.encrypt_file(str(file), str(target), recipients)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        if recipients:
            shutil.rmtree(plain, ignore_errors=True)
