"""The local backend: in-process PyTorch policies, built-in or from a local model directory."""

from backends.local.builtin import (
    BUILTIN_PREFIX,
    BUILTIN_SIZES,
    build_model,
    build_tokenizer,
    chat_prompt_ids,
    is_builtin,
    load_policy,
    save_policy,
)

__all__ = [
    "BUILTIN_PREFIX",
    "BUILTIN_SIZES",
    "build_model",
    "build_tokenizer",
    "chat_prompt_ids",
    "is_builtin",
    "load_policy",
    "save_policy",
]
