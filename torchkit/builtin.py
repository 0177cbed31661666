"""Built-in policies (used by every backend), and loading/saving any policy from a local directory.

A built-in policy is a small Qwen2-architecture causal LM with random weights and a
character-level tokenizer (printable ASCII and newline, one token per character, ChatML special
tokens, one token for each fixed piece of the tool-call format), all made on this machine. A
policy is named by a spec: `builtin:<size>` or the path of a local Hugging Face model directory.
Invariants: nothing is ever downloaded (anything else is a `UsageError`), and the same size and
seed give bit-identical weights without touching the caller's RNG.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from unified.errors import UsageError

__all__ = [
    "BUILTIN_PREFIX",
    "BUILTIN_SIZES",
    "build_model",
    "build_tokenizer",
    "is_builtin",
    "load_policy",
    "load_tokenizer",
    "save_policy",
]

BUILTIN_PREFIX = "builtin:"

_MAX_POSITIONS = 256

# Qwen2Config keyword arguments per size. Parameter counts with the 109-token vocabulary
# (embeddings tied): tiny 802,560; small 3,965,440; base 12,094,336.
BUILTIN_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 384,
        "max_position_embeddings": _MAX_POSITIONS,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
        "max_position_embeddings": _MAX_POSITIONS,
    },
    "base": {
        "hidden_size": 384,
        "num_hidden_layers": 7,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 1152,
        "max_position_embeddings": _MAX_POSITIONS,
    },
}

_PAD, _IM_START, _IM_END, _EOT, _UNK = (
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|unk|>",
)
# Special tokens take ids 0..4 in this order; characters follow ("\n" is 5, " " is 6, "~" is 100);
# then the role tokens (101..104) and the tool-call pieces (105..108).
_SPECIAL_TOKENS = (_PAD, _IM_START, _IM_END, _EOT, _UNK)
_CHARACTERS = ("\n", *(chr(c) for c in range(32, 127)))
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
# The fixed text of every call in the tool-call format (`workflows.tool_calls`), one token each:
# `<tool_call>{"name": "calc", "arguments": {"expr": "3*7"}}</tool_call>` is 24 tokens, not 69.
# Qwen's tokenizer likewise has the two markers as tokens and spends a few BPE tokens on each
# JSON piece. They are ordinary (not special) tokens: decoding keeps them, so a sampled call
# reads back as text, and a reply spelled in single characters decodes to the same text.
_TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>", '{"name": "', '", "arguments": ')

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

# A compact ChatML: the four common roles are one token each (sequences are characters, so
# "<|im_start|>assistant\n" would cost 11 tokens of every prompt); other roles use ChatML's form.
# `tools` given to `apply_chat_template` open the prompt as a system message, one JSON schema a
# line. Tool calls are plain text in the assistant's content (format: workflows/tool_calls.py),
# so a re-rendered conversation extends the previous prompt plus the sampled reply's text.
_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant', 'tool'] %}<|{{ message['role'] }}|>"
    "{% else %}<|im_start|>{{ message['role'] }}\n{% endif %}"
    "{{ message['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# sdpa: on 2 CPU threads the tiny model at batch 64 x 64 runs as fast as with eager (forward
# ~140-200 ms, forward+backward ~380 ms for both, within noise); sdpa is faster on GPU and is
# what `from_pretrained` picks, so a built-in model and its reloaded copy run the same kernels.
_ATTN_IMPLEMENTATION = "sdpa"


def _builtin_names() -> str:
    return ", ".join(BUILTIN_PREFIX + size for size in BUILTIN_SIZES)


def is_builtin(spec: str) -> bool:
    """Whether `spec` names a built-in model (`builtin:<size>`); `load_policy` checks the size."""
    return spec.startswith(BUILTIN_PREFIX)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer of every built-in model, with its ChatML chat template.

    One token per character of printable ASCII and newline, no BOS added, `<|unk|>` for any
    other character; eos is `<|im_end|>`, pad is `<|pad|>`. The tool-call format's fixed pieces
    (`<tool_call>`, `</tool_call>`, `{"name": "`, `", "arguments": `) are one token each.
    Special-token text inside a string (say `"<|im_end|>"`) encodes to the special token, as in
    Qwen's tokenizer.

    Vocabulary entries are spelled in the byte-level alphabet of Qwen's BPE (" " is "Ġ", "\n" is
    "Ċ"): transformers 5's `AutoTokenizer` ignores the saved pipeline of a `qwen2` model directory
    and rebuilds a byte-level `Qwen2Tokenizer` from the vocabulary, so with this spelling any tool
    that loads a saved built-in policy that way (verl, vLLM) tokenizes printable ASCII identically.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    characters = [byte_level.pre_tokenize_str(c)[0][0] for c in _CHARACTERS]
    vocab = {token: i for i, token in enumerate((*_SPECIAL_TOKENS, *characters, *_ROLE_TOKENS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_UNK))
    # Isolate characters first so an unknown one is one `<|unk|>` whatever its UTF-8 length.
    # `[\s\S]` rather than `.`: the dot does not match "\n".
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), byte_level]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([*_SPECIAL_TOKENS, *_ROLE_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in _TOOL_CALL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        pad_token=_PAD,
        eos_token=_IM_END,
        unk_token=_UNK,
        model_max_length=_MAX_POSITIONS,
        # Clean-up would turn "a , b" into "a, b" on decode and break the round trip.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def build_model(
    size: str, *, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None
) -> Qwen2ForCausalLM:
    """A randomly initialised built-in model of `size`, identical for the same size and seed.

    The caller's RNG state is left as it was. Special-token ids come from `tokenizer` (the
    built-in one when omitted); the vocabulary is exactly `len(tokenizer)`.
    """
    if size not in BUILTIN_SIZES:
        raise UsageError(
            f"unknown built-in model size {size!r}; use one of {', '.join(BUILTIN_SIZES)}"
        )
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    settings: dict[str, Any] = {
        **BUILTIN_SIZES[size],
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": True,
        # transformers 5 keeps rope_theta inside rope_parameters.
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "attn_implementation": _ATTN_IMPLEMENTATION,
    }
    config = Qwen2Config(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def check_model_spec(spec: str) -> None:
    """Raise the `UsageError` `load_policy(spec)` would, without loading anything."""
    if is_builtin(spec):
        if spec.removeprefix(BUILTIN_PREFIX) not in BUILTIN_SIZES:
            raise UsageError(f"unknown built-in model {spec!r}; use one of {_builtin_names()}")
    elif not spec.strip():
        raise UsageError(
            f"model spec is empty; pass a local model directory or one of {_builtin_names()}"
        )
    else:
        _model_directory(spec)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars from transformers' loading and saving: a trainer loads and saves the
    policy many times (sampler copies, checkpoints, evaluations), and each drew a bar."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_policy(
    spec: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (on CPU, in eval mode) and tokenizer named by `spec`, never downloaded.

    `builtin:<size>` builds a built-in model from `seed`; anything else must be a local Hugging
    Face model directory (with `config.json`). Any other spec raises `UsageError`.
    """
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    check_model_spec(spec)
    if is_builtin(spec):
        size = spec.removeprefix(BUILTIN_PREFIX)
        builtin_tokenizer = build_tokenizer()
        model = build_model(size, seed=seed, tokenizer=builtin_tokenizer)
        model.to(dtype=dtype)  # type: ignore[call-arg]  # transformers wraps `to` untypably
        model.train(False)
        return model, builtin_tokenizer
    directory = _model_directory(spec)
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, dtype=dtype
            )
        tokenizer = load_tokenizer(directory)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"cannot load model directory {spec!r}: {reason}; pass a directory written by "
            f"save_pretrained (weights, config.json and tokenizer files)"
        ) from e
    embedding = model.get_input_embeddings()
    if isinstance(embedding, torch.nn.Embedding) and len(tokenizer) > embedding.num_embeddings:
        raise UsageError(
            f"model directory {spec!r}: the tokenizer has {len(tokenizer)} tokens but the model "
            f"embeds only {embedding.num_embeddings}; save the matching tokenizer with the model"
        )
    model.train(False)
    return model, tokenizer


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `directory`, of the class its tokenizer_config.json declares.

    transformers 5's `AutoTokenizer` swaps a declared generic class (`TokenizersBackend`) for the
    model type's own class in some model types (`qwen2` among them), rebuilding the pipeline from
    the vocabulary alone; loading the declared class keeps `tokenizer.json` exactly as saved.
    """
    config_path = directory / "tokenizer_config.json"
    declared = None
    if config_path.is_file():
        declared = json.loads(config_path.read_text(encoding="utf-8")).get("tokenizer_class")
    if declared in _GENERIC_TOKENIZER_CLASSES and (directory / "tokenizer.json").is_file():
        tokenizer: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(
            directory, local_files_only=True
        )
        return tokenizer
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _model_directory(spec: str) -> Path:
    """The local model directory `spec` names, or a `UsageError` that says what to pass instead."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"model directory {spec!r} has no config.json; pass a Hugging Face model "
                f"directory (written by save_pretrained) or one of {_builtin_names()}"
            )
        # transformers 5 builds an empty tokenizer from config.json alone, without an error.
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise UsageError(
                f"model directory {spec!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                f"save the tokenizer into it with save_pretrained"
            )
        return path
    if path.exists():
        raise UsageError(
            f"model {spec!r} is a file, not a directory; pass the Hugging Face model directory "
            f"that holds it or one of {_builtin_names()}"
        )
    if path.is_absolute() or spec.startswith((".", "~")) or spec.endswith(os.sep):
        raise UsageError(
            f"model directory {spec!r} does not exist; pass an existing Hugging Face model "
            f"directory or one of {_builtin_names()}"
        )
    raise UsageError(
        f"model {spec!r} is not a local directory and models are not downloaded at run time; "
        f"download it beforehand (`hf download {spec} --local-dir DIR`) and pass DIR, "
        f"or use one of {_builtin_names()}"
    )


def save_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | os.PathLike[str]
) -> None:
    """Write `model` (safetensors) and `tokenizer` to `directory`, replacing it atomically.

    Everything is written into a sibling temporary directory first, so `directory` is never
    half-written: a reader sees the old policy, no directory (for the instant between two
    renames), or the new policy. `load_policy(str(directory))` gives back identical logits.
    """
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = target.with_name(f".{target.name}.tmp-{suffix}")
    retired = target.with_name(f".{target.name}.old-{suffix}")
    staging.mkdir()
    moved_aside = False
    try:
        with _quiet_transformers():
            model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # os.replace cannot overwrite a non-empty directory: move the old one aside first.
        if target.exists():
            os.replace(target, retired)
            moved_aside = True
        os.replace(staging, target)
    except BaseException:
        if moved_aside and not target.exists():
            os.replace(retired, target)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)
