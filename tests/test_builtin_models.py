"""Built-in models of the local backend: tokenizer, chat template, init, save/load, bad specs."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from torchkit.builtin import (
    BUILTIN_SIZES,
    build_model,
    build_tokenizer,
    is_builtin,
    load_policy,
    save_policy,
)
from unified.chat import chat_prompt_ids
from unified.errors import UsageError
from workflows.tool_calls import TOOL_CALL_END, TOOL_CALL_START

REPO_ROOT = Path(__file__).resolve().parents[1]
PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 2?"},
]
SPACED_TEXT = "x = 1 ,\n\n  y don 't !"
CALL_TEXT = '<tool_call>{"name": "calc", "arguments": {"expr": "3 * 7"}}</tool_call> = 21\n'
RENDERED = "<|system|>Be brief.<|im_end|><|user|>2 + 2?<|im_end|><|assistant|>"
TOOL_CALL_PIECES = (TOOL_CALL_START, TOOL_CALL_END, '{"name": "', '", "arguments": ')


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny built-in policy saved once for the tests that only read it back."""
    directory = tmp_path_factory.mktemp("saved") / "policy"
    save_policy(*load_policy("builtin:tiny"), directory)
    return directory


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


@settings(deadline=None, max_examples=200)
@given(text=st.text(alphabet=st.sampled_from(PRINTABLE)))
def test_tokenizer_round_trips_printable_ascii_one_token_per_character(text: str) -> None:
    # Special-token text and the tool-call pieces encode to one token each, by design.
    assume("<|" not in text and not any(piece in text for piece in TOOL_CALL_PIECES))
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(text)
    assert len(ids) == len(text), f"expected one id per character of {text!r}, got {ids}"
    assert tokenizer.decode(ids) == text, f"decode(encode({text!r})) changed the text"


def test_encode_adds_no_bos(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("a b")

    assert ids == [71, 6, 72], f"expected the ids of 'a', ' ', 'b' alone, got {ids}"


def test_special_tokens_have_fixed_ids_and_roles(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.convert_tokens_to_ids(
        ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|unk|>"]
    )

    assert ids == [0, 1, 2, 3, 4], f"special-token ids moved: {ids}"
    assert tokenizer.encode("\n !~") == [5, 6, 7, 100], "characters follow the special tokens"
    assert len(tokenizer) == 109, "vocabulary: 5 special, 96 characters, 4 roles, 4 call pieces"
    roles = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"])
    assert roles == [101, 102, 103, 104], f"role-token ids moved: {roles}"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|pad|>")
    assert tokenizer.bos_token is None, "no BOS: prompts start with a role token"


def test_a_tool_call_spends_one_token_on_each_fixed_piece_and_decodes_back(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    body = '{"expr": "3*7"}}'
    call = f'{TOOL_CALL_START}{{"name": "calc", "arguments": {body}{TOOL_CALL_END}'
    ids = tokenizer.encode(call)

    assert len(ids) == 4 + len("calc") + len(body), f"{len(ids)} tokens: {ids}"
    assert ids[0] == 105 and ids[-1] == 106, "the markers are tokens 105 and 106"
    assert tokenizer.decode(ids, skip_special_tokens=True) == call, "the pieces decode as text"
    spelled = [i for c in call for i in tokenizer.encode(c)]
    assert tokenizer.decode(spelled) == call, "a call sampled in single characters reads the same"


def test_unknown_character_maps_to_unk(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.encode("é\t") == [tokenizer.unk_token_id] * 2


def test_special_token_text_encodes_to_one_special_token(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    assert tokenizer.encode("a<|im_end|>") == [tokenizer.convert_tokens_to_ids("a"), 2]


def test_chat_template_renders_chatml_with_generation_prompt(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)

    assert rendered == RENDERED


def test_chat_prompt_ids_are_a_flat_list_of_the_rendered_text(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = chat_prompt_ids(tokenizer, MESSAGES)

    assert isinstance(ids, list) and all(type(i) is int for i in ids), f"not list[int]: {ids!r}"
    assert ids == tokenizer.encode(RENDERED)
    assert ids[-1] == 103, "prompt ends with the <|assistant|> token"


def test_chat_prompt_ids_without_generation_prompt_end_after_the_last_message(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = chat_prompt_ids(tokenizer, MESSAGES, add_generation_prompt=False)

    assert tokenizer.decode(ids) == RENDERED.removesuffix("<|assistant|>")


def test_chat_prompt_ids_unwraps_a_tokenizer_that_returns_a_mapping() -> None:
    class MappingTokenizer:
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Mapping[str, list[int]]:
            return {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]}

    assert chat_prompt_ids(MappingTokenizer(), MESSAGES) == [1, 2, 3]


@pytest.mark.parametrize(
    ("size", "low", "high"),
    [("tiny", 0.5e6, 1.5e6), ("small", 3e6, 5e6), ("base", 10e6, 14e6)],
)
def test_builtin_parameter_counts_are_within_their_stated_ranges(
    size: str, low: float, high: float
) -> None:
    count = sum(p.numel() for p in build_model(size).parameters())

    assert low <= count <= high, f"{size} has {count:,} parameters"


def test_model_config_matches_the_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    config = build_model("tiny", tokenizer=tokenizer).config

    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.eos_token_id) == (0, 2)
    assert config.tie_word_embeddings and config.max_position_embeddings == 256
    assert config._attn_implementation == "sdpa"


def test_same_seed_gives_identical_weights() -> None:
    assert weights_equal(build_model("tiny", seed=3), build_model("tiny", seed=3))


def test_different_seeds_give_different_weights() -> None:
    assert not weights_equal(build_model("tiny", seed=0), build_model("tiny", seed=1))


def test_building_a_model_leaves_the_callers_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)

    build_model("tiny", seed=7)

    assert torch.equal(torch.rand(4), expected), "build_model consumed the global RNG"


def test_load_policy_builds_a_builtin_in_the_requested_dtype_in_eval_mode() -> None:
    model, tokenizer = load_policy("builtin:tiny", dtype=torch.bfloat16)

    assert model.dtype == torch.bfloat16
    assert not model.training
    assert tokenizer.encode("a b") == build_tokenizer().encode("a b")


def test_saved_policy_loads_back_with_identical_logits(tmp_path: Path) -> None:
    model, tokenizer = load_policy("builtin:tiny", seed=5)
    ids_BT = torch.tensor([chat_prompt_ids(tokenizer, MESSAGES)])
    save_policy(model, tokenizer, tmp_path / "policy")

    loaded, _ = load_policy(str(tmp_path / "policy"))

    with torch.no_grad():
        assert torch.equal(model(ids_BT).logits, loaded(ids_BT).logits)
    assert (tmp_path / "policy" / "model.safetensors").is_file(), "weights are safetensors"


def test_saved_tokenizer_encodes_and_templates_like_the_original(saved_policy: Path) -> None:
    tokenizer = build_tokenizer()

    _, loaded = load_policy(str(saved_policy))

    for text in (SPACED_TEXT, CALL_TEXT):
        assert loaded.encode(text) == tokenizer.encode(text), text
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.encode("é") == [4], "unknown characters still map to <|unk|> after a reload"
    assert chat_prompt_ids(loaded, MESSAGES) == chat_prompt_ids(tokenizer, MESSAGES)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (2, 0)


def test_saved_directory_tokenizes_the_same_through_plain_auto_tokenizer(
    saved_policy: Path,
) -> None:
    """transformers 5 loads a qwen2 directory as `Qwen2Tokenizer`, as verl and vLLM would."""
    tokenizer = build_tokenizer()

    loaded = AutoTokenizer.from_pretrained(saved_policy, local_files_only=True)

    for text in (SPACED_TEXT, CALL_TEXT):
        assert loaded.encode(text) == tokenizer.encode(text), (type(loaded).__name__, text)
        assert loaded.decode(loaded.encode(text)) == text
    assert chat_prompt_ids(loaded, MESSAGES) == chat_prompt_ids(tokenizer, MESSAGES)


def test_save_policy_replaces_an_existing_directory_and_leaves_no_staging(
    tmp_path: Path,
) -> None:
    target = tmp_path / "policy"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    model, tokenizer = load_policy("builtin:tiny")

    save_policy(model, tokenizer, target)

    assert not (target / "stale.txt").exists(), "the old directory was merged, not replaced"
    assert [p.name for p in tmp_path.iterdir()] == ["policy"], "staging directories left behind"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("builtin:huge", "builtin:tiny, builtin:small, builtin:base"),
        ("Qwen/Qwen2-0.5B", "not downloaded at run time"),
        ("/no/such/model_dir", "does not exist"),
        ("", "model spec is empty"),
    ],
)
def test_bad_spec_is_a_one_line_usage_error_naming_spec_and_fix(spec: str, expected: str) -> None:
    with pytest.raises(UsageError) as caught:
        load_policy(spec)

    message = str(caught.value)
    assert spec in message and expected in message, message
    assert "\n" not in message, "errors are one line"


def test_directory_without_config_json_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"has no config\.json"):
        load_policy(str(tmp_path))


def test_directory_without_tokenizer_files_is_a_usage_error(tmp_path: Path) -> None:
    model, _ = load_policy("builtin:tiny")
    model.save_pretrained(tmp_path)

    with pytest.raises(UsageError, match="has no tokenizer files"):
        load_policy(str(tmp_path))


def test_is_builtin_checks_the_scheme_only() -> None:
    assert is_builtin("builtin:tiny") and is_builtin("builtin:huge")
    assert not is_builtin("/models/builtin:tiny") and not is_builtin("Qwen/Qwen2-0.5B")
    assert set(BUILTIN_SIZES) == {"tiny", "small", "base"}


def test_importing_and_building_a_builtin_touches_no_network(tmp_path: Path) -> None:
    code = (
        "import socket\n"
        "def refuse(*args, **kwargs):\n"
        "    raise OSError('network access attempted')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "import torchkit.builtin as builtin\n"
        "model, tokenizer = builtin.load_policy('builtin:tiny')\n"
        "builtin.save_policy(model, tokenizer, 'policy')\n"
        "builtin.load_policy('policy')\n"
    )
    hf_home = tmp_path / "hf_home"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(hf_home),
        "PYTHONPATH": str(REPO_ROOT),
    }

    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not hf_home.exists() or not any(hf_home.rglob("*")), "something was cached"
