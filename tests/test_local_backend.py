"""The local backend on the built-in tiny model: sampling, logprobs, training, checkpoints."""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from backends.local.backend import LocalBackend, split_threads
from tests.conftest import ConfigFactory
from torchkit import sampler as sampler_module
from torchkit.builtin import load_policy
from torchkit.decoding import GROUP_OVERHEAD, group_overhead, prefill_groups
from unified import UnifiedTrainer
from unified.config import TrainerConfig, load_config
from unified.errors import BackendError, CapabilityError, ConfigError, UsageError
from unified.protocol import (
    DEFAULT_TIS_CAP,
    BackendCapabilities,
    check_capabilities,
    create_backend,
    resolve_partial_rollout,
    resolve_tis_cap,
)
from unified.rollout import SamplingEngine
from unified.sequences import sequences_of
from unified.types import Episode, ModelOutput, SamplingParams, Step, Trajectory, TrajectoryGroup

# A seeded request's logprobs alone and in a batch agree to this (docs/guide.md, "Sampling").
SEEDED_LOGPROB_TOLERANCE = 1e-5

PROMPTS = ["3 5 7 -> 22", "12 4 -> 3", "1 2 3 -> 6", "9 9 -> 81"]


def local_config(*, local: dict[str, Any] | None = None, **trainer: Any) -> TrainerConfig:
    return load_config(
        {
            "workflow": "examples.countdown.workflow:CountdownWorkflow",
            "model": "builtin:tiny",
            "trainer": {"lr": 1e-3, **trainer},
            "sampling": {"train": {"max_tokens": 8}},
            "local": local or {},
        }
    )


async def started(config: TrainerConfig | None = None) -> LocalBackend:
    backend = LocalBackend()
    await backend.setup(config or local_config())
    return backend


async def sample(backend: LocalBackend, prompt: str, seed: int, **kw: Any) -> ModelOutput:
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "stop": [], "seed": seed} | kw
    return await SamplingEngine(backend.token_sampler()).chat(
        [{"role": "user", "content": prompt}], **params
    )


def group_of(outputs: list[ModelOutput], advantages: list[float]) -> TrajectoryGroup:
    episodes = [
        Episode(
            task_id="t",
            rollout_index=i,
            trajectories=[Trajectory(steps=[Step(output=o, reward=a)], reward=a)],
        )
        for i, (o, a) in enumerate(zip(outputs, advantages, strict=True))
    ]
    return TrajectoryGroup(task_id="t", episodes=episodes, advantages=advantages, policy_version=0)


async def test_sampler_logprobs_equal_the_trainer_recomputed_logprobs() -> None:
    backend = await started()
    outputs = await asyncio.gather(*[sample(backend, p, i) for i, p in enumerate(PROMPTS)])
    rows = sequences_of([group_of(outputs, [0.0] * len(outputs))], loss="ppo")
    with torch.no_grad():
        recomputed = backend._score(backend.model, rows, with_entropy=False).logp_T
    sampled = torch.tensor([lp for o in outputs for lp in o.logprobs])
    assert (recomputed - sampled).abs().max().item() < 1e-5
    await backend.shutdown()


async def test_concurrent_requests_are_served_in_one_batch() -> None:
    backend = await started()
    outputs = await asyncio.gather(*[sample(backend, p, i) for i, p in enumerate(PROMPTS * 4)])
    assert len(outputs) == 16 and backend.sampler.batches == 1
    await backend.shutdown()


async def test_sampling_honours_seed_greedy_max_tokens_and_stop() -> None:
    backend = await started()
    a, b = await sample(backend, PROMPTS[0], 7), await sample(backend, PROMPTS[0], 7)
    assert a.completion_ids == b.completion_ids, "same seed, same completion"
    g1 = await sample(backend, PROMPTS[1], 1, temperature=0.0)
    g2 = await sample(backend, PROMPTS[1], 2, temperature=0.0)
    assert g1.completion_ids == g2.completion_ids, "greedy ignores the seed"
    short = await sample(backend, PROMPTS[2], 3, max_tokens=3)
    assert len(short.completion_ids) <= 3
    full = await sample(backend, PROMPTS[2], 5, max_tokens=8)
    assert len(full.text) > 2, f"need a few characters to pick a stop string from: {full.text!r}"
    stop = full.text[2]
    cut = await sample(backend, PROMPTS[2], 5, max_tokens=8, stop=[stop])
    assert stop not in cut.text and cut.finish_reason == "stop"
    await backend.shutdown()


async def test_a_stop_string_longer_than_sixteen_tokens_still_stops_sampling() -> None:
    backend = await started()
    full = await sample(backend, PROMPTS[0], 0, max_tokens=40)
    stop = full.text[-24:-2]
    assert len(backend.tokenizer.encode(stop, add_special_tokens=False)) > 16, repr(full.text)
    cut = await sample(backend, PROMPTS[0], 0, max_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[:-24]
    assert len(cut.completion_ids) < len(full.completion_ids), "sampling ended at the stop"
    await backend.shutdown()


def test_end_tokens_include_every_one_the_generation_config_names() -> None:
    model, tokenizer = load_policy("builtin:tiny", seed=0)
    specials = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert sampler_module._end_tokens(model, tokenizer) == specials
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7, 9]
    assert sampler_module._end_tokens(model, tokenizer) == specials | {7, 9}


async def test_sampler_keeps_old_weights_until_the_policy_update() -> None:
    backend = await started()
    outputs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS)]
    before = await sample(backend, PROMPTS[0], 99, temperature=0.0, max_tokens=4)
    await backend.forward_backward([group_of(outputs, [1.0, -1.0, 1.0, -1.0])])
    backend.set_learning_rate(0.05)
    await backend.optim_step()
    stale = await sample(backend, PROMPTS[0], 99, temperature=0.0, max_tokens=4)
    assert stale.logprobs == before.logprobs and stale.policy_version == 0
    await backend.on_policy_updated(1)
    fresh = await sample(backend, PROMPTS[0], 99, temperature=0.0, max_tokens=4)
    assert fresh.policy_version == 1 and fresh.logprobs != before.logprobs
    await backend.shutdown()


async def test_weight_sync_swaps_between_batches_and_waits_for_no_running_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = await started()
    greedy = {"temperature": 0.0, "max_tokens": 4}
    before = await sample(backend, PROMPTS[0], 99, **greedy)
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    entered, release = threading.Event(), threading.Event()
    real = sampler_module.generate_batch

    def held_batch(*args: Any, **kw: Any) -> list[ModelOutput]:
        entered.set()
        assert release.wait(10), "the test never released the batch"
        return real(*args, **kw)

    monkeypatch.setattr(sampler_module, "generate_batch", held_batch)
    running = asyncio.create_task(sample(backend, PROMPTS[0], 99, **greedy))
    assert await asyncio.to_thread(entered.wait, 10), "the batch never started"
    async with asyncio.timeout(10):
        await backend.on_policy_updated(1)  # returns while the batch is still running
    assert not running.done()
    release.set()
    async with asyncio.timeout(10):
        old = await running
    monkeypatch.setattr(sampler_module, "generate_batch", real)
    new = await sample(backend, PROMPTS[0], 99, **greedy)
    assert (old.policy_version, old.logprobs) == (0, before.logprobs), "finished on old weights"
    assert new.policy_version == 1 and new.logprobs != before.logprobs, "next batch is new"
    await backend.shutdown()


async def test_two_batches_run_at_once_and_a_load_waits_only_for_batches_on_its_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = await started(async_config(local={"sampler_batches": 2}))
    assert backend.sampler.parallel == 2
    entered, release = threading.Event(), threading.Event()
    real = sampler_module.generate_batch

    def first_held(*args: Any, **kw: Any) -> list[ModelOutput]:
        if not entered.is_set():
            entered.set()
            assert release.wait(10), "the test never released the batch"
        return real(*args, **kw)

    monkeypatch.setattr(sampler_module, "generate_batch", first_held)
    greedy = {"temperature": 0.0, "max_tokens": 4}
    held = asyncio.create_task(sample(backend, PROMPTS[0], 1, **greedy))
    try:
        assert await asyncio.to_thread(entered.wait, 10), "the first batch never started"
        async with asyncio.timeout(10):  # a second batch runs while the first is held
            other = await sample(backend, PROMPTS[1], 2, **greedy)
        assert other.completion_ids and not held.done()
        assert backend.sampler.batches == 1, "the second batch ended, the first still runs"
        async with asyncio.timeout(10):
            await backend.on_policy_updated(1)  # loads the standby copy: nothing runs on it
        # The next load goes into the copy the held batch runs on: it waits for that batch.
        second = asyncio.create_task(backend.on_policy_updated(2))
        done, _ = await asyncio.wait([second], timeout=0.3)
        assert not done, "the load did not wait for the batch on its copy"
    finally:
        release.set()
    async with asyncio.timeout(10):
        await second
        old = await held
    assert old.policy_version == 0 and backend.sampler.version == 2
    await backend.shutdown()


@pytest.mark.parametrize("local", [{}, {"lora_rank": 4}], ids=["full", "lora"])
async def test_checkpoint_round_trip_reproduces_the_next_step(
    tmp_path: Path, local: dict[str, Any]
) -> None:
    first = await started(local_config(local=local))
    outputs = [await sample(first, p, i) for i, p in enumerate(PROMPTS)]
    group = group_of(outputs, [1.0, -0.5, 0.5, -1.0])
    await first.forward_backward([group])
    await first.optim_step()
    await first.save_checkpoint(tmp_path / "ckpt")
    await first.forward_backward([group])
    await first.optim_step()

    second = await started(local_config(local=local))
    await second.load_checkpoint(tmp_path / "ckpt")
    await second.forward_backward([group])
    await second.optim_step()
    for (name, a), b in zip(
        first.model.state_dict().items(), second.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), f"{name} differs after the restored step"
    await first.shutdown()
    await second.shutdown()


async def test_a_load_drops_the_gradients_of_a_step_abandoned_before_it(tmp_path: Path) -> None:
    """A stop can abandon a step between its `forward_backward` and `optim_step`; a checkpoint
    holds no gradients, so a resume on the same backend object must not add them twice."""
    backend = await started()
    outputs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS)]
    group = group_of(outputs, [1.0, -0.5, 0.5, -1.0])
    await backend.save_checkpoint(tmp_path / "ckpt")
    other = group_of(outputs, [-1.0, 1.0, -0.5, 0.5])
    await backend.forward_backward([other])  # the abandoned step
    await backend.load_checkpoint(tmp_path / "ckpt")
    await backend.forward_backward([group])
    resumed = await backend.optim_step()

    fresh = await started()
    await fresh.load_checkpoint(tmp_path / "ckpt")
    await fresh.forward_backward([group])
    assert resumed["train/grad_norm"] == (await fresh.optim_step())["train/grad_norm"]
    for (name, a), b in zip(
        backend.model.state_dict().items(), fresh.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), f"{name}: the abandoned step's gradients were applied"
    await backend.shutdown()
    await fresh.shutdown()


async def test_a_batch_stops_decoding_the_requests_whose_callers_gave_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A workflow past its timeout, or a run stopping, cancels its requests: their batch must not
    decode them to max_tokens, holding the sampler (sync mode runs one batch at a time)."""
    from torchkit import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_end_tokens", lambda model, tokenizer: set())
    batches: list[list[ModelOutput]] = []
    generate_batch = sampler_module.generate_batch

    def recording(*args: Any, **kwargs: Any) -> list[ModelOutput]:
        batches.append(generate_batch(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(sampler_module, "generate_batch", recording)
    backend = await started(local_config().model_copy(update={"local": {"threads": 1}}))
    prompt = [5, 6, 7]
    long = SamplingParams(temperature=1.0, max_tokens=240, seed=1)
    callers = [asyncio.create_task(backend.sampler.sample(prompt, long)) for _ in range(32)]
    await asyncio.sleep(0.2)  # the batch is decoding
    for caller in callers:
        caller.cancel()
    await asyncio.gather(*callers, return_exceptions=True)
    async with asyncio.timeout(30):
        await backend.sampler.wait_idle()
    (abandoned,) = batches
    assert {o.finish_reason for o in abandoned} == {"aborted"}
    assert max(len(o.completion_ids) for o in abandoned) < 240, "decoded to max_tokens"
    short = await backend.sampler.sample(prompt, SamplingParams(max_tokens=2, seed=2))
    assert len(short.completion_ids) == 2
    await backend.shutdown()


async def test_a_weight_load_waits_for_batches_on_its_copy_within_a_deadline() -> None:
    backend = await started()
    sampler = backend.sampler
    state = backend.model.state_dict()
    await asyncio.to_thread(sampler.load_weights, state, 1)  # the first load makes the standby
    assert sampler._standby is not None
    sampler._standby.batches += 1  # a batch stuck on the older copy
    sampler.load_timeout_s = 0.2
    with pytest.raises(BackendError, match="1 sampling batch\\(es\\) still running"):
        await asyncio.to_thread(sampler.load_weights, state, 2)
    sampler._standby.release()
    await asyncio.to_thread(sampler.load_weights, state, 2)
    assert sampler.version == 2
    await backend.shutdown()


async def test_any_int_seed_samples_and_fails_no_other_request_of_its_batch() -> None:
    backend = await started()
    engine = SamplingEngine(backend.token_sampler())
    seeds = [0, 1, 2**64, 2**70 + 3, -5]
    outputs = await asyncio.gather(
        *(engine.complete([5, 6, 7], max_tokens=4, seed=seed, temperature=1.0) for seed in seeds)
    )
    again = await engine.complete([5, 6, 7], max_tokens=4, seed=2**70 + 3, temperature=1.0)
    assert all(o.completion_ids for o in outputs)
    # What a seed guarantees (docs/guide.md): the same tokens alone or in a batch; logprobs to
    # float rounding, which some CPUs' kernels (AVX512) vary with the batch size.
    assert again.completion_ids == outputs[3].completion_ids, "seeded: reproducible"
    assert again.logprobs == pytest.approx(outputs[3].logprobs, abs=SEEDED_LOGPROB_TOLERANCE)
    await backend.shutdown()


async def test_a_shutdown_cut_short_leaves_the_training_lock_free() -> None:
    """A shutdown cancelled while a training call runs must not take the lock for good: a next
    setup of the same backend would block on it."""
    backend = await started()
    backend._forward_backward = lambda groups: (time.sleep(1.0), {})[1]  # type: ignore[method-assign]
    training = asyncio.create_task(backend.forward_backward([]))
    await asyncio.sleep(0.1)
    training.cancel()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await backend.shutdown()
    await asyncio.sleep(1.5)  # the training pass has finished by now
    assert not backend._training.locked()
    await backend.setup(local_config())
    async with asyncio.timeout(10):
        await backend.optim_step()
    await backend.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_few_optimizer_steps_on_countdown(make_config: ConfigFactory, mode: str) -> None:
    config = make_config(
        mode=mode,
        backend="local",
        workflow="examples.countdown.workflow:CountdownWorkflow",
        model="builtin:tiny",
        data={"train": {"generator": "examples.countdown.tasks:make_tasks", "n": 32}},
        trainer={
            "total_steps": 2,
            "batch_size": 2,
            "group_size": 3,
            "lr": 1e-3,
            "filter_groups": False,
        },
        sampling={"train": {"max_tokens": 6}},
    )
    result = UnifiedTrainer(config).fit()
    assert result.steps == 2
    for key in ("train/loss", "train/kl_sample_train", "train/entropy", "train/grad_norm"):
        assert key in result.metrics, key
    truncated_is = {"train/is_ratio_mean", "train/is_clipped_frac"}
    assert (truncated_is <= set(result.metrics)) == (mode == "async"), "TIS on in async only"
    recorded = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert recorded["async"]["partial_rollout"] is (mode == "async"), "resolved and recorded"
    assert result.metrics["tokens/discarded"] == 0 and result.metrics["lag/token_max"] >= 0


async def test_a_batched_request_gets_what_it_would_get_alone() -> None:
    backend = await started()
    lengths = [2, 8, 5, 1, 8, 3]  # rows finish at different steps and leave the batch
    batched = await asyncio.gather(
        *[sample(backend, PROMPTS[i % 4], 10 + i, max_tokens=n) for i, n in enumerate(lengths)]
    )
    for i, n in enumerate(lengths):
        alone = await sample(backend, PROMPTS[i % 4], 10 + i, max_tokens=n)
        assert alone.completion_ids == batched[i].completion_ids, f"request {i}"
        assert alone.logprobs == pytest.approx(batched[i].logprobs, abs=1e-5)
    await backend.shutdown()


async def test_prompts_of_very_different_lengths_prefill_in_groups_and_score_exactly() -> None:
    backend = await started()
    engine = SamplingEngine(backend.token_sampler())
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "stop": [], "seed": 3}
    prompts = [[10 + i % 50] * n for i, n in enumerate([3, 4, 120, 118, 60, 3])]
    assert len(prefill_groups([len(p) for p in prompts])) > 1
    outputs = await asyncio.gather(*[engine.complete(p, **params) for p in prompts])
    assert backend.sampler.batches == 1
    for output in outputs:
        expected = teacher_forced_logprobs(backend.sampler.model, output)
        assert output.logprobs == pytest.approx(expected, abs=1e-5)
    await backend.shutdown()


@pytest.mark.parametrize(
    "lengths", [[7], [30] * 34, [30, 31, 90, 92, 29, 60] * 10, [1, 250, 2, 249, 125, 3] * 4]
)
def test_prefill_groups_cover_every_row_once_at_its_width(lengths: list[int]) -> None:
    groups = prefill_groups(lengths)
    rows = sorted(r for group, _ in groups for r in group)
    assert rows == list(range(len(lengths)))
    assert all(width == max(lengths[r] for r in group) for group, width in groups)
    cost = sum(len(group) * width + GROUP_OVERHEAD for group, width in groups)
    assert cost <= len(lengths) * max(lengths) + GROUP_OVERHEAD, "no worse than one group"
    if len(set(lengths)) == 1:
        assert len(groups) == 1
    if max(lengths) - min(lengths) > 2 * GROUP_OVERHEAD:
        assert len(groups) > 1, "far apart lengths are not padded to each other"


def test_a_gpu_prefills_a_batch_of_mixed_lengths_as_one_group_where_a_cpu_splits_it() -> None:
    # The sampler bench's batch: 64 prompts of 14-83 tokens (H200: 24 ms as one group, 49 in 3).
    lengths = [14 + (i * 23) % 70 for i in range(64)]
    cpu = prefill_groups(lengths, group_overhead(torch.device("cpu")))
    gpu = prefill_groups(lengths, group_overhead(torch.device("cuda")))
    assert len(cpu) > 1 and len(gpu) == 1


async def test_an_empty_prompt_is_a_usage_error() -> None:
    backend = await started()
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4, "stop": [], "seed": 0}
    with pytest.raises(UsageError, match="at least one token"):
        await SamplingEngine(backend.token_sampler()).complete([], **params)
    await backend.shutdown()


async def test_a_batch_may_mix_a_long_prompt_with_a_long_completion() -> None:
    backend = await started()
    limit = backend.sampler.max_positions
    assert limit is not None
    params = {"temperature": 1.0, "top_p": 1.0, "stop": [], "seed": 0}
    engine = SamplingEngine(backend.token_sampler())
    long_prompt, short_prompt = [10] * (limit - 16), [10] * 8
    # Each fits on its own; together they need more cache than the model has positions.
    outputs = await asyncio.gather(
        engine.complete(long_prompt, max_tokens=16, **params),
        engine.complete(short_prompt, max_tokens=limit - 8, **params),
    )
    assert backend.sampler.batches == 1
    assert all(o.completion_ids for o in outputs)
    await backend.shutdown()


def async_config(**sections: Any) -> TrainerConfig:
    return load_config(
        {
            "workflow": "examples.countdown.workflow:CountdownWorkflow",
            "model": "builtin:tiny",
            "mode": "async",
            **sections,
        }
    )


def teacher_forced_logprobs(model: torch.nn.Module, output: ModelOutput) -> list[float]:
    """Each completion token's logprob under `model` (temperature 1), by one full forward."""
    ids = torch.tensor([output.prompt_ids + output.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start, n = len(output.prompt_ids) - 1, len(output.completion_ids)
    logp = torch.log_softmax(logits[start : start + n], -1)
    return logp.gather(1, torch.tensor(output.completion_ids)[:, None])[:, 0].tolist()


async def test_partial_rollout_across_a_weight_sync_keeps_its_tokens_and_records_versions() -> None:
    backend = await started(async_config(**{"async": {"partial_rollout": True}}))
    sampler = backend.sampler
    uncut = await sample(backend, PROMPTS[0], 5, max_tokens=12)
    assert len(uncut.completion_ids) == 12, "pick a seed that samples no end token"
    old_model = copy.deepcopy(sampler.model)
    sampler.load_weights(sampler.model.state_dict(), 0)  # makes the standby copy before the hook
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trained = backend.model.state_dict()
    cut_at, calls, synced_at = 4, 0, 0.0

    def sync_mid_batch(*_: Any) -> None:
        nonlocal calls, synced_at
        calls += 1
        if calls == cut_at:  # the sync lands while this batch decodes its 4th token
            sampler.load_weights(trained, 1)
            synced_at = time.time()

    hook = sampler.model.lm_head.register_forward_hook(sync_mid_batch)
    batches = sampler.batches
    async with asyncio.timeout(30):
        out = await sample(backend, PROMPTS[0], 5, max_tokens=12)
    hook.remove()

    n = len(out.completion_ids)
    assert sampler.batches - batches == 2, "cut at the sync, continued in the next batch"
    assert out.policy_version == 0 and out.oldest_version == 0 and out.finish_reason != "aborted"
    assert out.token_versions == [0] * cut_at + [1] * (n - cut_at)
    assert out.token_times is not None, "the built-in sampler reports its token times"
    first, last = out.token_times
    assert first < synced_at < last, "the first token is the first batch's, the last the next's"
    assert out.completion_ids[:cut_at] == uncut.completion_ids[:cut_at], "tokens before it kept"
    assert out.logprobs[:cut_at] == uncut.logprobs[:cut_at], "logprobs before it kept"
    old_lp, new_lp = (
        teacher_forced_logprobs(old_model, out),
        teacher_forced_logprobs(backend.model, out),
    )
    assert out.logprobs[:cut_at] == pytest.approx(old_lp[:cut_at], abs=1e-4), "v0 tokens"
    assert out.logprobs[cut_at:] == pytest.approx(new_lp[cut_at:], abs=1e-4), "v1 tokens"
    assert out.logprobs[cut_at:] != pytest.approx(old_lp[cut_at:], abs=1e-3), "weights differ"
    await backend.shutdown()


async def test_truncated_is_weights_a_hand_made_mixed_version_batch() -> None:
    backend = await started(async_config(trainer={"loss": "importance_sampling"}))
    assert backend.tis_cap == DEFAULT_TIS_CAP, "on by default in async mode"
    sampled = await sample(backend, PROMPTS[1], 3, max_tokens=6)
    n = len(sampled.completion_ids)
    prox = torch.tensor(teacher_forced_logprobs(backend.model, sampled), dtype=torch.float64)
    # Tokens from version 0 that the sampler found far less likely than the trainer does now
    # (ratio over the cap), then version-1 tokens close to the trainer's.
    ratio = torch.tensor([5.0, 3.0, 1.5, 0.5, 1.0, 0.8][:n], dtype=torch.float64)
    old = (prox - ratio.log()).clamp(max=0.0)
    ratio = (prox - old).exp()
    stale = sampled.model_copy(
        update={"logprobs": old.tolist(), "token_versions": [0, 0] + [1] * (n - 2)}
    )
    reference = copy.deepcopy(backend.model)
    metrics = await backend.forward_backward([group_of([stale], [1.5])])

    weight = ratio.clamp(max=DEFAULT_TIS_CAP)
    assert metrics["train/is_ratio_mean"] == pytest.approx(weight.mean().item(), rel=1e-4)
    assert metrics["train/is_clipped_frac"] == pytest.approx(2 / n)
    assert metrics["train/ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-4)
    # The gradient is the capped-weight policy gradient -sum(w * A * grad logp).
    chunk = sequences_of([group_of([stale], [1.5])], loss="ppo")
    logp = backend._score(reference, chunk, with_entropy=False).logp_T
    (-(weight.float() * 1.5 * logp).sum()).backward()
    for (name, p), q in zip(backend.model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    await backend.shutdown()


async def test_a_trajectorys_calls_weigh_as_one_sequence_across_micro_batches() -> None:
    """`seq_mean_token_mean` over a two-call and a one-call trajectory: the same gradient whether
    the calls share a micro-batch or not, and the value of weighting each trajectory once."""
    grads = []
    for micro_batch in (64, 1):
        config = load_config(
            {
                "workflow": "examples.countdown.workflow:CountdownWorkflow",
                "model": "builtin:tiny",
                "trainer": {
                    "lr": 1e-3,
                    "entropy_coef": 0.0,
                    "kl_coef": 0.0,
                    "loss_agg": "seq_mean_token_mean",
                },
                "local": {"forward_batch_size": micro_batch},
            }
        )
        backend = await started(config)
        first, second, alone = [await sample(backend, p, i) for i, p in enumerate(PROMPTS[:3])]
        two_calls = Trajectory(steps=[Step(output=first), Step(output=second)], reward=1.0)
        one_call = Trajectory(steps=[Step(output=alone)], reward=0.0)
        episodes = [
            Episode(task_id="t", rollout_index=i, trajectories=[t])
            for i, t in enumerate([two_calls, one_call])
        ]
        group = TrajectoryGroup(
            task_id="t", episodes=episodes, advantages=[1.0, -1.0], policy_version=0
        )
        metrics = await backend.forward_backward([group])
        # At ratio 1 the ppo loss is -A per token: each trajectory's token mean is -A.
        assert metrics["train/loss"] == pytest.approx(0.0, abs=1e-6), metrics
        grads.append([p.grad.clone() for p in backend.model.parameters() if p.grad is not None])
        await backend.shutdown()
    for whole, split in zip(*grads, strict=True):
        torch.testing.assert_close(whole, split, rtol=1e-4, atol=1e-7)


def test_tis_cap_auto_is_on_in_async_mode_for_backends_that_honour_it() -> None:
    local = LocalBackend.capabilities
    assert resolve_tis_cap(async_config(), local) == DEFAULT_TIS_CAP
    assert resolve_tis_cap(local_config(), local) is None, "off in sync mode"
    assert resolve_tis_cap(async_config(trainer={"tis_cap": None}), local) is None
    assert resolve_tis_cap(local_config(tis_cap=3), local) == 3.0, "explicit applies in sync too"
    assert resolve_tis_cap(async_config(), BackendCapabilities()) is None, "auto: off elsewhere"


@pytest.mark.parametrize(("spec", "on"), [("local", True), ("verl", True), ("tinker", False)])
def test_partial_rollouts_are_on_by_default_in_async_mode_where_the_backend_can(
    spec: str, on: bool
) -> None:
    caps = create_backend(spec).capabilities
    assert resolve_partial_rollout(async_config(), caps) is on
    assert resolve_partial_rollout(local_config(), caps) is False, "sync: nothing spans a sync"
    off = async_config(**{"async": {"partial_rollout": False}})
    assert resolve_partial_rollout(off, caps) is False, "an explicit choice stands"


@pytest.mark.parametrize("spec", ["tinker", "verl"])
def test_backends_without_truncated_is_refuse_a_tis_cap_and_turn_auto_off(spec: str) -> None:
    backend = create_backend(spec)
    with pytest.raises(
        CapabilityError, match=rf"trainer\.tis_cap=2\.0 is not supported by backend '{spec}'"
    ):
        check_capabilities(async_config(trainer={"tis_cap": 2}), backend)
    check_capabilities(async_config(), backend)  # auto: accepted, and off
    assert resolve_tis_cap(async_config(), backend.capabilities) is None


@pytest.mark.parametrize(
    ("estimator", "function"), [("full", "full_kl"), ("forward", "forward_kl")]
)
async def test_local_exact_kls_take_the_vocabulary_wide_log_probs(
    monkeypatch: pytest.MonkeyPatch, estimator: str, function: str
) -> None:
    from backends.local import backend as backend_module
    from torchkit import losses

    seen: list[tuple[torch.Size, torch.Size, float | None]] = []
    exact = getattr(losses, function)

    def recording(lp: torch.Tensor, ref: torch.Tensor, clamp: float | None) -> torch.Tensor:
        seen.append((lp.shape, ref.shape, clamp))
        return exact(lp, ref, clamp)  # type: ignore[no-any-return]

    monkeypatch.setattr(backend_module, function, recording)
    local = {"kl_estimator": estimator, "kl_clamp": 10.0}
    config = local_config(kl_coef=0.1).model_copy(update={"local": local})
    backend = await started(config)
    out = await sample(backend, PROMPTS[0], 0)
    metrics = await backend.forward_backward([group_of([out], [1.0])])
    vocab = backend.model.config.vocab_size
    shape = torch.Size([len(out.completion_ids), vocab])
    assert seen == [(shape, shape, 10.0)] and math.isfinite(metrics["train/loss"])
    await backend.shutdown()


@pytest.mark.parametrize("estimator", ["k3", "full", "forward"])
async def test_local_reports_the_kl_to_the_reference(estimator: str) -> None:
    """`train/kl_reference` (KL(train || ref) as the tinker and verl backends report it; with
    `forward` KL(ref || train)): 0 while the policy is the reference, above 0 once an update
    moved it; absent without a KL term."""
    config = local_config(kl_coef=0.1, lr=1e-2).model_copy(
        update={"local": {"kl_estimator": estimator}}
    )
    backend = await started(config)
    out = await sample(backend, PROMPTS[0], 0)
    groups = [group_of([out, await sample(backend, PROMPTS[0], 1)], [1.0, 0.0])]
    before = await backend.forward_backward(groups)
    await backend.optim_step()
    after = await backend.forward_backward(groups)
    assert abs(before["train/kl_reference"]) < 1e-6 and after["train/kl_reference"] > 1e-6
    await backend.shutdown()
    plain = await started(local_config(kl_coef=0.0))
    metrics = await plain.forward_backward([group_of([await sample(plain, PROMPTS[0], 0)], [1.0])])
    assert "train/kl_reference" not in metrics
    await plain.shutdown()


@pytest.mark.parametrize("kl_clamp", [None, 10.0])
async def test_local_kl_clamp_reaches_the_kl_term(
    monkeypatch: pytest.MonkeyPatch, kl_clamp: float | None
) -> None:
    """The math of both forms is checked against verl's in test_verl_parity.py."""
    from backends.local import backend as backend_module
    from torchkit.losses import kl_penalty

    clamps = []

    def recording(logp_T: torch.Tensor, ref_T: torch.Tensor, clamp: float | None) -> torch.Tensor:
        clamps.append(clamp)
        return kl_penalty(logp_T, ref_T, clamp)

    monkeypatch.setattr(backend_module, "kl_penalty", recording)
    config = local_config(kl_coef=0.1).model_copy(update={"local": {"kl_clamp": kl_clamp}})
    backend = await started(config)
    metrics = await backend.forward_backward(
        [group_of([await sample(backend, PROMPTS[0], 0)], [1.0])]
    )
    assert clamps == [kl_clamp] and math.isfinite(metrics["train/loss"])
    await backend.shutdown()


async def test_local_optimizer_settings_reach_adamw() -> None:
    optimizer = {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}
    backend = await started(local_config(lr=2e-4, optimizer=optimizer))
    (group,) = backend.optimizer.param_groups
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        2e-4,
        (0.8, 0.99),
        1e-6,
        0.1,
    )
    await backend.shutdown()


@pytest.mark.parametrize(
    ("total", "sampler", "concurrent", "expected"),
    [
        (2, None, True, (1, 1)),  # async on 2 cores: one each
        (2, None, False, (2, 2)),  # sync: they take turns, each uses both
        (8, 2, True, (2, 6)),
        (4, 4, True, (4, 4)),  # the sampler given all of them: no split
        (1, None, True, (1, 1)),
        (3, 2, False, (2, 3)),
    ],
)
def test_threads_split_between_sampling_and_training_only_when_they_run_at_once(
    total: int, sampler: int | None, concurrent: bool, expected: tuple[int, int]
) -> None:
    assert split_threads(total, sampler, concurrent) == expected


async def test_the_thread_split_reaches_the_sampler_and_the_training_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = async_config(local={"threads": 2}, trainer={"kl_coef": 0.0})
    backend = await started(config)
    assert backend.sampler.threads == 1
    seen: list[int] = []
    real = backend._forward_backward

    def recording(groups: list[TrajectoryGroup]) -> dict[str, float]:
        seen.append(torch.get_num_threads())
        return real(groups)

    monkeypatch.setattr(backend, "_forward_backward", recording)
    await backend.forward_backward([group_of([await sample(backend, PROMPTS[0], 0)], [1.0])])
    assert seen == [1]
    await backend.shutdown()


async def test_more_sampler_threads_than_threads_is_a_config_error() -> None:
    config = async_config(local={"threads": 2, "sampler_threads": 3})
    with pytest.raises(ConfigError, match=r"local\.sampler_threads is 3, more than the 2"):
        await started(config)


async def step_with_reference(overlap: bool, estimator: str) -> tuple[Any, list[Any], list[Any]]:
    """One step's metrics and gradients, and where the reference was scored (thread, threads)."""
    local = {
        "threads": 2,
        "forward_batch_size": 1,
        "kl_estimator": estimator,
        "overlap_reference": overlap,
    }
    config = async_config(local=local, trainer={"kl_coef": 0.1, "entropy_coef": 0.01})
    backend = await started(config)
    assert (backend._reference_pool is not None) == overlap
    outs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS[:3])]
    with torch.no_grad():  # move the policy off the reference, so the KL term is not zero
        for p in backend.model.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    where: list[tuple[str, int]] = []
    real = backend._score

    def recording(model: torch.nn.Module, *args: Any, **kw: Any) -> Any:
        if model is backend.reference:
            where.append((threading.current_thread().name, torch.get_num_threads()))
        return real(model, *args, **kw)

    backend._score = recording  # type: ignore[method-assign]
    metrics = await backend.forward_backward([group_of(outs, [1.0, -0.5, -0.5])])
    grads = [p.grad.clone() for p in backend.model.parameters() if p.grad is not None]
    await backend.shutdown()
    return metrics, grads, where


@pytest.mark.parametrize("estimator", ["k3", "full", "forward"])
async def test_the_reference_scored_beside_the_policy_gives_the_same_step(estimator: str) -> None:
    """Async mode scores the KL reference in its own thread on the sampler's share; the losses
    and gradients are those of scoring it inline, micro-batch by micro-batch."""
    inline, inline_grads, inline_where = await step_with_reference(False, estimator)
    overlapped, overlapped_grads, overlapped_where = await step_with_reference(True, estimator)
    assert len(inline_where) == len(overlapped_where) == 3  # one micro-batch per sample
    assert not any(name.startswith("local-reference") for name, _ in inline_where)
    assert all(name.startswith("local-reference") and n == 1 for name, n in overlapped_where)
    assert overlapped == pytest.approx(inline, rel=1e-6, abs=1e-9)
    for a, b in zip(inline_grads, overlapped_grads, strict=True):
        torch.testing.assert_close(a, b)


async def test_the_reference_is_overlapped_only_where_the_threads_are_split() -> None:
    kl = {"kl_coef": 0.05}
    for config, expected in [
        (async_config(local={"threads": 2}, trainer=kl), True),
        (async_config(local={"threads": 2}), False),  # no KL term, no reference
        (async_config(local={"threads": 2, "sampler_threads": 2}, trainer=kl), False),  # shared
        (local_config(**kl), False),  # sync: training has every thread
    ]:
        backend = await started(config)
        assert (backend._reference_pool is not None) is expected, config.local
        await backend.shutdown()
        assert backend._reference_pool is None


@pytest.mark.parametrize(
    ("estimator", "vocabulary_kept"), [("k3", False), ("full", True), ("forward", True)]
)
async def test_the_reference_scores_one_chunk_ahead_keeping_only_what_the_kl_reads(
    monkeypatch: pytest.MonkeyPatch, estimator: str, vocabulary_kept: bool
) -> None:
    """A chunk's scores over the vocabulary are [tokens, vocab]: with a real vocabulary, holding
    every chunk's at once ran a pass out of memory."""
    local = {"threads": 2, "forward_batch_size": 1, "kl_estimator": estimator}
    backend = await started(async_config(local=local, trainer={"kl_coef": 0.05}))
    outs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS)]
    submitted: list[int] = []
    seen: list[tuple[int, bool]] = []
    submit, backward = backend._reference_score, backend._backward_chunk

    def counting(chunks: Any, index: int) -> Any:
        future = submit(chunks, index)
        submitted.extend([index] if future is not None else [])
        return future

    def recording(chunk: Any, reference: Any, *args: Any) -> None:
        seen.append((len(submitted), reference.result().log_probs_TV.numel() > 0))
        backward(chunk, reference, *args)

    monkeypatch.setattr(backend, "_reference_score", counting)
    monkeypatch.setattr(backend, "_backward_chunk", recording)
    metrics = await backend.forward_backward([group_of(outs, [1.0, -0.5, 0.5, -1.0])])
    assert [n for n, _ in seen] == [2, 3, 4, 4], "chunk i's pass starts with i + 2 submitted"
    assert {kept for _, kept in seen} == {vocabulary_kept}
    assert math.isfinite(metrics["train/kl_reference"])
    await backend.shutdown()


async def test_a_failing_pass_leaves_no_reference_work_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = async_config(local={"threads": 2, "forward_batch_size": 1}, trainer={"kl_coef": 0.05})
    backend = await started(config)
    assert backend._reference_pool is not None
    outs = [await sample(backend, p, i) for i, p in enumerate(PROMPTS[:3])]
    started_chunks: list[int] = []
    real = backend._score_reference

    def slow(chunk: Any) -> Any:
        started_chunks.append(len(chunk))
        return real(chunk)

    def failing(*args: Any) -> None:
        raise RuntimeError("policy pass failed")

    monkeypatch.setattr(backend, "_score_reference", slow)
    monkeypatch.setattr(backend, "_backward_chunk", failing)
    with pytest.raises(RuntimeError, match="policy pass failed"):
        await backend.forward_backward([group_of(outs, [1.0, -0.5, -0.5])])
    count = len(started_chunks)
    await asyncio.sleep(0.2)
    assert len(started_chunks) == count <= 3, "no reference chunk starts after the failure"
    monkeypatch.undo()
    metrics = await backend.forward_backward([group_of(outs, [1.0, -0.5, -0.5])])
    assert math.isfinite(metrics["train/loss"])
    await backend.shutdown()
