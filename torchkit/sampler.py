"""The batching sampler: batched generation with per-token logprobs, serving concurrent requests.

`generate_batch` samples a whole batch of prompts with per-row settings (temperature, top-p, max
tokens, stop strings, seed). `BatchingSampler` serves concurrent async requests: requests that
arrive while a batch runs join the next batch. No background task is needed: the first waiting
request whose batch has not run yet starts it in a worker thread; a request cancelled meanwhile
(e.g. by a workflow timeout) does not lose the batch for the others. With `parallel` > 1, up to
that many batches run at once, each in its own thread: an agent's turns reach the sampler at
different times, and a batch that starts while another decodes keeps a second core busy.

The sampler holds its own copy of the policy's weights, so asynchronous training really samples
from an older policy. `load_weights` (the weight sync) loads the new weights into a second,
standby copy and swaps it in: a batch already running finishes on the weights it started with,
the next batch uses the new ones, and the sync waits for no batch (only for one still running on
the standby copy, when two syncs land inside one batch).

With a prefix cache (`prefix_cache_mb`), each finished request's keys and values are kept, and a
prompt that extends one (an agent's next turn) prefills only its new tokens; each set of weights
has its own entries, so every logprob is still that of the weights sampling.

With `partial_rollout=True` a sync also cuts the running batch at its next token boundary: each
unfinished request keeps the tokens and logprobs it has, goes back to the front of the queue, and
continues in the next batch under the new weights (its prompt and tokens so far are prefilled
again, so the KV cache matches the weights). Every token's logprob comes from the weights that
sampled it, and the output records each token's version in `token_versions`.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from torchkit.decoding import make_stepper
from torchkit.prefix_cache import PrefixCache
from unified.errors import BackendError, UsageError
from unified.types import FinishReason, ModelOutput, SamplingParams

__all__ = ["BatchingSampler", "Request", "check_request", "generate_batch"]


@dataclass(eq=False)  # identity: the queue's membership tests must not compare prompts
class Request:
    """One sampling request and, once the batch ran, its result.

    `prefix` is what the request sampled before a weight sync cut it (partial rollouts): the next
    batch continues from there.
    """

    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[ModelOutput] | None = field(default=None, repr=False)
    prefix: ModelOutput | None = field(default=None, repr=False)
    abandoned: bool = False
    """Set by the event loop when the caller gave up: its batch stops decoding it."""


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, max_positions: int | None
) -> None:
    """Refuse a request the model cannot serve: an empty prompt, or more tokens than positions.

    Per request: each row's positions count from its own first token, so a batch may mix a long
    prompt with a long completion as long as every request fits on its own.
    """
    if not prompt_ids:
        # Nothing to condition on, and the trainer could not score the first token.
        raise UsageError("complete() needs a prompt of at least one token, got none")
    needed = len(prompt_ids) + params.max_tokens
    if max_positions is not None and needed > max_positions:
        raise UsageError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the "
            f"model's {max_positions} positions; shorten the prompt or lower max_tokens"
        )


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[Request],
    *,
    version: int,
    max_positions: int | None = None,
    cut: Callable[[], bool] | None = None,
    prefix_cache: PrefixCache | None = None,
    generation: int = 0,
) -> list[ModelOutput]:
    """Sample every request of one batch; blocking (call it from a worker thread).

    A request with a `prefix` continues it. When `cut()` turns true (checked after each token),
    the batch stops there and its unfinished requests come back with `finish_reason="aborted"`
    and the tokens sampled so far. With a `prefix_cache` (its entries computed by the weights of
    `generation`), a prompt that starts with a sequence run before prefills only the rest, and
    each finished request's sequence is stored for the prompts that will extend it.
    """
    for r in requests:
        check_request(r.prompt_ids, r.params, max_positions)
    B = len(requests)
    tokens = [list(r.prefix.completion_ids) if r.prefix else [] for r in requests]
    logprobs = [list(r.prefix.logprobs) if r.prefix else [] for r in requests]
    versions = [_token_versions(r.prefix) for r in requests]
    contexts = [r.prompt_ids + done for r, done in zip(requests, tokens, strict=True)]
    offsets = [len(done) for done in tokens]
    max_new = max(r.params.max_tokens - n for r, n in zip(requests, offsets, strict=True))
    L = max(len(c) for c in contexts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    ids_BL = torch.full((B, L), pad, dtype=torch.long)
    mask_BL = torch.zeros(B, L, dtype=torch.long)
    for b, context in enumerate(contexts):
        ids_BL[b, L - len(context) :] = torch.tensor(context)
        mask_BL[b, L - len(context) :] = 1
    ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
    temperature_B = torch.tensor([r.params.temperature for r in requests], device=device)
    greedy_B = temperature_B == 0
    safe_t_B = torch.where(greedy_B, 1.0, temperature_B)[:, None]
    top_p_B = torch.tensor([r.params.top_p for r in requests], device=device)
    any_top_p = bool((top_p_B < 1).any())
    # A continued request picks up its seed's uniforms where it was cut.
    uniforms_BN = torch.stack(
        [_uniforms(r.params.seed, n + max_new)[n:] for r, n in zip(requests, offsets, strict=True)]
    ).to(device)
    eos = _end_tokens(model, tokenizer)

    stepper = make_stepper(model, B, L + max_new)
    if not stepper.reuses_prefixes:
        prefix_cache = None
    prefixes = None
    if prefix_cache is not None:
        prefixes = [prefix_cache.get(context, generation) for context in contexts]
    logits_BV = stepper.prefill(ids_BL, mask_BL, prefixes).float()
    finish: list[FinishReason | None] = [None] * B
    first_at, last_at = 0.0, [0.0] * B  # wall-clock times of the first and each last token
    rows = list(range(B))  # request index of each row still in the batch
    for t in range(max_new):
        logp_BV = torch.log_softmax(logits_BV / safe_t_B, dim=-1)
        next_B = _sample(logp_BV, greedy_B, uniforms_BN[:, t], top_p_B if any_top_p else None)
        chosen_B = logp_BV.gather(1, next_B[:, None])[:, 0]
        next_list, chosen_list = next_B.tolist(), chosen_B.tolist()
        now = time.time()
        first_at = first_at or now
        ended: list[tuple[int, int]] = []  # (row in the batch, request) that finished now
        for i, b in enumerate(rows):
            if finish[b] is not None:
                continue  # finished, but still in the batch until the next compaction
            r = requests[b]
            last_at[b] = now
            tokens[b].append(next_list[i])
            logprobs[b].append(chosen_list[i])
            versions[b].append(version)
            if next_list[i] in eos or _hit_stop(tokenizer, tokens[b], r.params.stop):
                finish[b] = "stop"
            elif len(tokens[b]) >= r.params.max_tokens:
                finish[b] = "length"
            if finish[b] is not None:
                ended.append((i, b))
        if prefix_cache is not None:
            for i, b in ended:  # the last token was sampled, never run: it is not stored
                kv = stepper.saved(i)
                assert kv is not None
                sequence = requests[b].prompt_ids + tokens[b][:-1]
                prompt = len(requests[b].prompt_ids)
                prefix_cache.put(sequence, kv, generation, also=prompt)
        for b in rows:
            if finish[b] is None and requests[b].abandoned:
                finish[b] = "aborted"  # no one reads it: no more compute spent on it
        keep = [i for i, b in enumerate(rows) if finish[b] is None]
        if not keep:
            break
        if cut is not None and cut():
            for i in keep:
                finish[rows[i]] = "aborted"
            break
        index = torch.tensor(keep, device=device) if len(keep) <= len(rows) * 3 // 4 else None
        if index is not None and stepper.keep(index):
            # Finished rows leave the batch: no more compute spent on them.
            rows = [rows[i] for i in keep]
            next_B, safe_t_B, greedy_B = next_B[index], safe_t_B[index], greedy_B[index]
            top_p_B, uniforms_BN = top_p_B[index], uniforms_BN[index]
        logits_BV = stepper.step(next_B).float()
    return [
        ModelOutput(
            text=_text(tokenizer, tokens[b], eos, r.params.stop),
            prompt_ids=list(r.prompt_ids),
            completion_ids=tokens[b],
            logprobs=[min(0.0, lp) for lp in logprobs[b]],
            finish_reason=finish[b] or "length",
            policy_version=r.prefix.policy_version if r.prefix else version,
            # Recorded only when the request spans a sync; otherwise every token has policy_version.
            token_versions=versions[b] if r.prefix or finish[b] == "aborted" else None,
            temperature=r.params.temperature,
            token_times=_token_times(r.prefix, first_at, last_at[b]),
        )
        for b, r in enumerate(requests)
    ]


def _token_versions(prefix: ModelOutput | None) -> list[int]:
    if prefix is None:
        return []
    if prefix.token_versions is not None:
        return list(prefix.token_versions)
    return [prefix.policy_version] * len(prefix.completion_ids)


def _token_times(
    prefix: ModelOutput | None, first: float, last: float
) -> tuple[float, float] | None:
    """A request's first and last token times; a continued request's first is its prefix's."""
    if not last:  # nothing sampled (it was cut before its first token)
        return prefix.token_times if prefix else None
    return (prefix.token_times[0] if prefix and prefix.token_times else first), last


def _uniforms(seed: int | None, n: int) -> torch.Tensor:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:  # any int: torch takes 64 bits, and one request's seed must not fail its batch
        generator.manual_seed(seed % 2**64)
    return torch.rand(n, generator=generator, dtype=torch.float64)


def _sample(
    logp_BV: torch.Tensor,
    greedy_B: torch.Tensor,
    u_B: torch.Tensor,
    top_p_B: torch.Tensor | None,
) -> torch.Tensor:
    """Inverse-CDF sampling with a pre-drawn uniform per row (reproducible per seed)."""
    probs_BV = logp_BV.double().exp()
    if top_p_B is not None:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        keep_BV = (sorted_BV.cumsum(-1) - sorted_BV) < top_p_B[:, None]
        sorted_BV = sorted_BV * keep_BV
        cdf_BV = sorted_BV.cumsum(-1)
        index_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None])[:, 0]
        index_B = index_B.clamp(max=probs_BV.shape[-1] - 1)
        sampled_B = order_BV.gather(1, index_B[:, None])[:, 0]
    else:
        cdf_BV = probs_BV.cumsum(-1)
        index_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None])[:, 0]
        sampled_B = index_B.clamp(max=probs_BV.shape[-1] - 1)
    return torch.where(greedy_B, logp_BV.argmax(-1), sampled_B)


def _hit_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: list[str]) -> bool:
    if not stop:
        return False
    # Every token spells at least one byte, and a character at most four: a window of this many
    # tokens holds any stop string that ends in it.
    window = max(16, 4 * max(len(s) for s in stop))
    tail = tokenizer.decode(ids[-window:])
    return any(s in tail for s in stop)


def _end_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end a completion: the tokenizer's end and pad tokens, and every end token the
    model's generation config names (chat models often have several, e.g. end-of-turn ids)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        configured = [configured]
    ids = (tokenizer.eos_token_id, tokenizer.pad_token_id, *(configured or ()))
    return {t for t in ids if t is not None}


def _text(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], eos: set[int], stop: list[str]
) -> str:
    text: str = tokenizer.decode([i for i in ids if i not in eos])
    for s in stop:
        cut = text.find(s)
        if cut >= 0:
            text = text[:cut]
    return text


class _Weights:
    """One copy of the sampling weights, its policy version, and the batches running on it.

    `generation` changes with every load: what the prefix cache holds from other weights is
    not reused, even under the same version number (a checkpoint loaded again)."""

    _loads = itertools.count()

    def __init__(self, model: PreTrainedModel, version: int) -> None:
        self.model = model
        self.version = version
        self.generation = next(self._loads)
        self.batches = 0  # running on these weights
        self.unused = threading.Condition()

    def release(self) -> None:
        with self.unused:
            self.batches -= 1
            self.unused.notify_all()


def copy_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy `state_dict` (any dtype, any device) into `model`'s tensors, one at a time.

    A host tensor moves to the model's accelerator before its dtype is converted: a blocking
    copy would convert on the host first (PyTorch does, to save accelerator memory), through an
    fp32 temporary of every weight. Names must match as `load_state_dict` requires.
    """
    targets = model.state_dict()
    if targets.keys() != state_dict.keys() or any(
        t.shape != state_dict[name].shape for name, t in targets.items()
    ):
        model.load_state_dict(state_dict)  # raises, naming the keys and shapes that differ
        return
    for name, target in targets.items():
        source = state_dict[name]
        if source.device != target.device:
            source = source.to(target.device, non_blocking=True)
        target.copy_(source)
    if any(t.is_cuda for t in targets.values()):
        torch.cuda.synchronize()


class BatchingSampler:
    """Serves concurrent `sample` calls by batching them over a private copy of the weights.

    It is the `unified.protocol.TokenSampler` of the backends that sample in-process.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch: int = 64,
        partial_rollout: bool = False,
        threads: int | None = None,
        prefix_cache_mb: float = 0.0,
        parallel: int = 1,
        load_timeout_s: float | None = None,
    ) -> None:
        sampling = copy.deepcopy(model).eval()
        for p in sampling.parameters():
            p.requires_grad_(False)
        self._current = _Weights(sampling, version=0)
        self._standby: _Weights | None = None  # made at the first sync
        self._swap = threading.Lock()  # guards which copy is current
        self._loading = threading.Lock()  # one weight load at a time
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.partial_rollout = partial_rollout
        self.threads = threads  # torch CPU threads of each batch; None: the worker thread's own
        self.parallel = parallel  # batches that may run at once
        # How long a weight load may wait for the batches still running on the copy it fills.
        self.load_timeout_s = load_timeout_s
        # Keys and values of finished requests, for the prompts that extend them (an agent's
        # next turn); shared by the running batches.
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20)) if prefix_cache_mb else None
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.batches = 0
        self._queue: list[Request] = []
        self._running: set[asyncio.Future[Any]] = set()
        self._batch_done: asyncio.Future[None] | None = None

    @property
    def model(self) -> PreTrainedModel:
        """The weights the next batch samples from."""
        return self._current.model

    @property
    def version(self) -> int:
        """The policy version of `model`."""
        return self._current.version

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Make `state_dict` the sampling weights of `version` for every batch that starts later.

        Blocking (call it from a worker thread). A running batch keeps the weights it started with,
        or, with `partial_rollout`, stops at its next token and continues on these in the next.
        """
        with self._loading:
            standby = self._standby
            if standby is None:
                standby = _Weights(copy.deepcopy(self._current.model), version)
            # No batch starts on the standby copy (only on the current one): wait for those
            # still running on it.
            with standby.unused:
                if not standby.unused.wait_for(
                    lambda: standby.batches == 0, timeout=self.load_timeout_s
                ):
                    raise BackendError(
                        f"a weight load waited {self.load_timeout_s:g} s for "
                        f"{standby.batches} sampling batch(es) still running on older weights; a "
                        "batch is stuck, or raise trainer.backend_timeout_s if batches run this "
                        "long"
                    )
            with torch.no_grad():
                copy_weights(standby.model, state_dict)
                standby.version = version
                standby.generation = next(_Weights._loads)
            with self._swap:
                self._standby, self._current = self._current, standby

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        """Sample one completion; batched with whatever else is waiting."""
        # Checked before joining, so one bad request cannot fail the batch it would join.
        check_request(prompt_ids, params, self.max_positions)
        loop = asyncio.get_running_loop()
        request = Request(list(prompt_ids), params, loop.create_future())
        assert request.future is not None
        self._queue.append(request)
        try:
            while not request.future.done():
                if len(self._running) < self.parallel and request in self._queue:
                    # Let requests made in the same tick (e.g. a gather) join this batch.
                    await asyncio.sleep(0)
                if len(self._running) < self.parallel and request in self._queue:
                    self._start_batch(loop)
                if self._batch_done is None or self._batch_done.done():
                    self._batch_done = loop.create_future()
                # Futures only (no helper tasks): wake when ours is served or any batch ends.
                await asyncio.wait(
                    [request.future, self._batch_done], return_when=asyncio.FIRST_COMPLETED
                )
            return request.future.result()
        finally:
            if not request.future.done():
                request.abandoned = True
                request.future.cancel()
                if request in self._queue:
                    self._queue.remove(request)

    async def wait_idle(self) -> None:
        """Wait for the batches running in worker threads, if any."""
        if self._running:
            await asyncio.wait(list(self._running))

    def _start_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = [r for r in self._queue[: self.max_batch] if r.future and not r.future.done()]
        del self._queue[: self.max_batch]
        if not batch:
            return
        running = loop.run_in_executor(None, self._run, batch)
        self._running.add(running)

        def deliver(done: asyncio.Future[list[ModelOutput]]) -> None:
            self._running.discard(done)
            self.batches += 1
            error = (
                asyncio.CancelledError("sampling batch cancelled")
                if done.cancelled()
                else done.exception()
            )
            cut: list[Request] = []
            for i, r in enumerate(batch):
                if r.future is None or r.future.done():
                    continue
                if error is not None:
                    r.future.set_exception(error)
                    continue
                output = done.result()[i]
                if output.finish_reason == "aborted":
                    r.prefix = output
                    cut.append(r)
                else:
                    r.future.set_result(output)
            # Cut requests go first: they have waited longest.
            self._queue[:0] = cut
            if self._batch_done is not None and not self._batch_done.done():
                self._batch_done.set_result(None)

        running.add_done_callback(deliver)

    def _run(self, batch: list[Request]) -> list[ModelOutput]:
        with self._swap:
            weights = self._current
            with weights.unused:
                weights.batches += 1

        def swapped() -> bool:
            return self._current is not weights

        if self.threads is not None:
            torch.set_num_threads(self.threads)  # OpenMP counts per OS thread
        try:
            return generate_batch(
                weights.model,
                self.tokenizer,
                batch,
                version=weights.version,
                max_positions=self.max_positions,
                cut=swapped if self.partial_rollout else None,
                prefix_cache=self.prefix_cache,
                generation=weights.generation,
            )
        finally:
            weights.release()
