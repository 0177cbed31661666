"""Chat templating: messages become prompt token ids here, once, for every backend.

The core's `SamplingEngine` renders a workflow's messages with the policy tokenizer's own chat
template (`apply_chat_template`) and hands the backend token ids only, so a backend, an
inference engine or an OpenAI-compatible gateway never templates a second time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from unified.protocol import ChatTokenizer

__all__ = ["chat_prompt_ids"]


def chat_prompt_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, as a flat list.

    transformers 5 `apply_chat_template(..., tokenize=True)` returns a `BatchEncoding` by default
    (`return_dict=True`); this asks for a list and still unwraps a mapping, so the result is a
    `list[int]` for any tokenizer with a chat template. `tools` (OpenAI function declarations)
    go to the template, which declares them as it was trained to (an OpenAI-compatible gateway
    passes a request's `tools` here).
    """
    extra: dict[str, Any] = {"tools": [dict(tool) for tool in tools]} if tools else {}
    encoded = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **extra,
    )
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    if not (isinstance(encoded, list) and all(isinstance(t, int) for t in encoded)):
        raise TypeError(f"apply_chat_template gave {type(encoded).__name__}, not a list of ids")
    return encoded
