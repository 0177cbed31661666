"""The local sampler's prefix cache: an agent's next turn prefills only its new tokens, and
samples exactly what it would without the cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from backends.local.backend import LocalBackend
from tests.test_local_backend import teacher_forced_logprobs
from torchkit.builtin import load_policy
from torchkit.decoding import prefill_groups
from torchkit.prefix_cache import KeyValues, PrefixCache
from torchkit.sampler import Request, generate_batch
from unified.config import TrainerConfig, load_config
from unified.rollout import SamplingEngine
from unified.types import ModelOutput, SamplingParams

PARAMS = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "stop": []}


def kv(n: int, fill: float = 0.0) -> KeyValues:
    return KeyValues(torch.full((2, 1, n, 4), fill), torch.full((2, 1, n, 4), fill))


def test_the_longest_stored_prefix_is_found_and_the_last_token_always_runs() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3], kv(3, 1.0), generation=0)
    cache.put([1, 2, 3, 4, 5], kv(5, 2.0), generation=0)
    found = cache.get([1, 2, 3, 4, 5, 6, 7], generation=0)
    assert found is not None and found.length == 5 and float(found.keys[0, 0, 0, 0]) == 2.0
    shorter = cache.get([1, 2, 3, 4, 5], generation=0)  # the whole prompt stored: not all of it
    assert shorter is not None and shorter.length == 3
    assert cache.get([1, 2, 9, 9], generation=0) is None
    assert cache.get([7, 1, 2, 3, 4], generation=0) is None
    assert (cache.lookups, cache.hits, cache.reused_tokens) == (4, 2, 8)


def test_a_prompt_is_also_found_by_its_own_length_for_a_reply_encoded_again() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3, 40, 41], kv(5), generation=0, also=3)  # prompt [1, 2, 3], reply 40, 41
    found = cache.get([1, 2, 3, 40, 42, 43], generation=0)  # the reply came back as 40, 42
    assert found is not None and found.length == 3
    assert found.keys.shape == (2, 1, 3, 4)


def test_other_weights_empty_the_cache() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3], kv(3), generation=0)
    assert cache.get([1, 2, 3, 4], generation=1) is None and len(cache) == 0
    assert cache.nbytes == 0


def test_a_batch_on_older_weights_neither_reads_nor_clears_the_newer_entries() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    cache.put([1, 2, 3], kv(3), generation=1)
    assert cache.get([1, 2, 3, 4], generation=0) is None
    cache.put([5, 6, 7], kv(3), generation=0)  # a batch still running on the old weights
    assert len(cache) == 1 and cache.get([5, 6, 7, 8], generation=1) is None
    found = cache.get([1, 2, 3, 4], generation=1)
    assert found is not None and found.length == 3


def test_least_recently_used_entries_go_first_within_the_budget() -> None:
    entry = kv(3).keys.nbytes * 2
    cache = PrefixCache(max_bytes=2 * entry)
    cache.put([1, 1, 1], kv(3), generation=0)
    cache.put([2, 2, 2], kv(3), generation=0)
    assert cache.get([1, 1, 1, 9], generation=0) is not None  # [1, 1, 1] used last
    cache.put([3, 3, 3], kv(3), generation=0)
    assert len(cache) == 2 and cache.nbytes == 2 * entry
    assert cache.get([2, 2, 2, 9], generation=0) is None
    assert cache.get([1, 1, 1, 9], generation=0) is not None
    assert cache.get([3, 3, 3, 9], generation=0) is not None
    cache.put([4] * 30, kv(30), generation=0)  # larger than the whole budget: not stored
    assert len(cache) == 2


def test_keys_and_values_must_match_the_tokens() -> None:
    with pytest.raises(ValueError, match="2 keys and values for 3 tokens"):
        PrefixCache(max_bytes=1 << 20).put([1, 2, 3], kv(2), generation=0)


def config(prefix_cache_mb: float) -> TrainerConfig:
    return load_config(
        {
            "workflow": "examples.countdown.workflow:CountdownWorkflow",
            "model": "builtin:tiny",
            "local": {"prefix_cache_mb": prefix_cache_mb},
        }
    )


async def conversation(backend: LocalBackend, seed: int, turns: int = 3) -> list[ModelOutput]:
    """A conversation whose every prompt extends the last prompt and reply, as an agent's does."""
    engine = SamplingEngine(backend.token_sampler())
    tail = backend.tokenizer.encode("= 12")
    prompt = backend.tokenizer.encode(f"{seed} 5 7 -> 22")
    outputs = []
    for turn in range(turns):
        out = await engine.complete(prompt, **PARAMS, seed=seed * 10 + turn)
        outputs.append(out)
        prompt = out.prompt_ids + out.completion_ids + tail
    return outputs


async def started(prefix_cache_mb: float) -> LocalBackend:
    backend = LocalBackend()
    await backend.setup(config(prefix_cache_mb))
    return backend


async def test_later_turns_reuse_the_conversation_and_sample_what_they_would_without() -> None:
    plain, cached = await started(0), await started(256)
    assert plain.sampler.prefix_cache is None and cached.sampler.prefix_cache is not None
    # Several conversations at once: rows with and without a cached prefix share batches.
    runs: list[Any] = []
    for backend in (plain, cached):
        runs.append(await asyncio.gather(*[conversation(backend, seed) for seed in range(6)]))
    cache = cached.sampler.prefix_cache
    assert cache.hits == 12 and cache.reused_tokens > 0, "turns 2 and 3 of six conversations"
    for without, with_cache in zip(*runs, strict=True):
        for a, b in zip(without, with_cache, strict=True):
            assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
            expected = teacher_forced_logprobs(cached.sampler.model, b)
            assert b.logprobs == pytest.approx(expected, abs=1e-5)
    await plain.shutdown()
    await cached.shutdown()


async def test_a_weight_sync_leaves_nothing_to_reuse() -> None:
    backend = await started(256)
    first = (await conversation(backend, 1, turns=1))[0]
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    await backend.on_policy_updated(1)
    tail = backend.tokenizer.encode("= 12")
    prompt = first.prompt_ids + first.completion_ids + tail
    out = await SamplingEngine(backend.token_sampler()).complete(prompt, **PARAMS, seed=4)
    cache = backend.sampler.prefix_cache
    assert cache is not None and cache.hits == 0
    assert out.logprobs == pytest.approx(teacher_forced_logprobs(backend.model, out), abs=1e-5)
    await backend.shutdown()


def test_a_batch_mixing_cached_and_fresh_prompts_samples_what_it_would_without() -> None:
    """A continued prompt (4 new tokens) and fresh ones of other lengths in one batch: they
    prefill together, the continued row's cached tokens inside the group run again."""
    model, tokenizer = load_policy("builtin:tiny", seed=0)
    first = Request(tokenizer.encode("3 5 7 -> 22"), SamplingParams(**PARAMS, seed=1))
    cache = PrefixCache(max_bytes=1 << 24)
    (out,) = generate_batch(model, tokenizer, [first], version=0, prefix_cache=cache)
    assert len(cache) == 1
    continued = out.prompt_ids + out.completion_ids + tokenizer.encode("= 12")
    prompts = [continued, tokenizer.encode("1 2 3 4 5 6 7 8 9 -> 45"), [5, 6]]
    new_tokens = [len(continued) - (len(out.prompt_ids) + len(out.completion_ids) - 1)]
    new_tokens += [len(p) for p in prompts[1:]]
    ((_, width),) = prefill_groups(new_tokens)  # one group: as wide as the fresh prompt
    assert width > new_tokens[0]

    def batch(prefix_cache: PrefixCache | None) -> list[ModelOutput]:
        requests = [
            Request(p, SamplingParams(**PARAMS, seed=20 + i)) for i, p in enumerate(prompts)
        ]
        return generate_batch(model, tokenizer, requests, version=0, prefix_cache=prefix_cache)

    hits = cache.hits
    with_cache, without = batch(cache), batch(None)
    assert cache.hits == hits + 1
    for a, b in zip(without, with_cache, strict=True):
        assert a.completion_ids == b.completion_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert b.logprobs == pytest.approx(teacher_forced_logprobs(model, b), abs=1e-5)
