"""What the local Tinker server does for each request, independent of HTTP.

`LocalTinker` serves one base model (built-in or a local directory) through the torch kit
(`torchkit/`): training models are LoRA copies of it (`training.py`), sampling sessions are weight
snapshots that the built-in sampler or vLLM samples (`sampling.py`, `vllm_sampling.py`).
Requests of one training model run one at a time in arrival order (the SDK sends them in order),
each in a worker thread, so the event loop keeps answering polls. Saved state lives under
`store/`: `tinker://<run>/<kind>/<name>` is the directory `store/<run>/<kind>/<name>/`, so a
later server on the same store resumes from it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_server.catalog import Catalog
from tinker_server.export import age_recipients, write_export
from tinker_server.futures import Outcome
from tinker_server.sampling import BuiltinEngine, SamplerPool, SnapshotEngine
from tinker_server.training import AdamSettings, LoraSpec, TrainingModel, UserError
from tinker_server.vllm_sampling import VllmEngine
from tinker_server.wire import (
    PROTOBUF,
    ForwardBackwardCall,
    encode_forward_backward_output,
    encode_sample_response,
)
from torchkit.builtin import is_builtin, load_policy
from torchkit.lora import untied_copy
from torchkit.vllm_settings import VllmSettings

__all__ = ["ENGINES", "LocalTinker"]

ENGINES = ("builtin", "vllm")
"""What samples the sessions (`tinker-serve --engine`): the built-in sampler, or vLLM."""
_KINDS = ("weights", "sampler_weights")
_SAVE_TYPE = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler"}
FINISHED_KEPT = 1024
_SAMPLE_REFUSED = {
    "topk_sample_logprobs": "top-k logprobs of sampled tokens are not served here",
    "target_prompt_logprobs": "scoring chosen ids at prompt positions is not served here",
    "prompt_alt_tokens_k": "alternative draws at prompt positions are not served here",
}
"""Sampling options the local server refuses rather than answering without them."""


def json_outcome(payload: dict[str, Any]) -> Outcome:
    """A JSON result."""
    return Outcome(body=json.dumps(payload).encode())


@dataclass
class _Model:
    training: TrainingModel
    base_model: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LocalTinker:
    """The models, sampling sessions and saved state of one local Tinker server."""

    def __init__(
        self,
        model: str,
        store: Path,
        *,
        max_batch: int = 64,
        keep_samplers: int = 8,
        aliases: Sequence[str] = (),
        engine: str = "builtin",
        vllm: VllmSettings | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        self.engine = engine
        self.vllm = vllm or VllmSettings()
        directory = not is_builtin(model) and Path(model).is_dir()
        self.model_spec = str(Path(model).resolve()) if directory else model
        """The served model's canonical name: `builtin:<size>` or an absolute directory."""
        self.aliases = [name for name in (model, *aliases) if name != self.model_spec]
        """Other names clients may use for it (`--model` as given, `--alias`)."""
        self.store = store
        self.max_batch = max_batch
        self.keep_samplers = keep_samplers
        self.models: dict[str, _Model] = {}
        self.sessions: set[str] = set()
        self.finished: dict[str, str] = {}
        """How the latest `FINISHED_KEPT` sessions ended, as their clients said."""
        self._sampling_sessions = 0
        self.catalog = Catalog(store)

    def load(self) -> None:
        """Load the base model and write its tokenizer where clients can read it (blocking)."""
        self.base, self.tokenizer = load_policy(self.model_spec)
        # Untied: merged unembedding adapters change the output layer only.
        self.template = untied_copy(self.base)
        engine: SnapshotEngine
        if self.engine == "vllm":
            engine = VllmEngine.start(self.template, self.tokenizer, self.vllm)
        else:
            engine = BuiltinEngine(self.template, self.tokenizer, max_batch=self.max_batch)
        self.pool = SamplerPool(engine, self.tokenizer, keep=self.keep_samplers)
        if is_builtin(self.model_spec):
            self.tokenizer_dir = self.store / "tokenizers" / self.model_spec.replace(":", "-")
            self.tokenizer_dir.mkdir(parents=True, exist_ok=True)
            self.tokenizer.save_pretrained(self.tokenizer_dir)
        else:
            self.tokenizer_dir = Path(self.model_spec).resolve()

    async def warm_up(self) -> None:
        """Ready the sampling engine after `load` (vLLM: its first reload now, at start, not in
        the first change of snapshot)."""
        if isinstance(self.pool.engine, VllmEngine):
            await self.pool.engine.warm_up()

    def close(self) -> None:
        """Free the sampling engine (vLLM's processes and files); blocking."""
        if hasattr(self, "pool"):
            self.pool.close()

    @property
    def tokenizer_id(self) -> str:
        """The tokenizer as `get_info` reports it: an absolute local directory."""
        return str(self.tokenizer_dir.resolve())

    @property
    def advertised(self) -> list[str]:
        """Names `get_server_capabilities` lists: the canonical one and, for a built-in model,
        the absolute directory holding its tokenizer (what a client can load it from offline,
        e.g. tinker-cookbook's `model_name`)."""
        names = [self.model_spec]
        if is_builtin(self.model_spec):
            names.append(self.tokenizer_id)
        return names

    def _check_base_model(self, name: str | None) -> str:
        if name is None or name in self.advertised or name in self.aliases:
            return self.model_spec
        if not is_builtin(name) and Path(name).resolve() == Path(self.model_spec).resolve():
            return self.model_spec
        raise UserError(
            f"base model {name!r} is not served here; this server serves {self.model_spec!r} "
            "(unified tinker-serve --model ..., --alias NAME for more names)"
        )

    # -- sessions and models ------------------------------------------------------------------

    def create_session(self) -> str:
        """A new client session id."""
        session_id = f"local-{uuid.uuid4().hex[:12]}"
        self.sessions.add(session_id)
        return session_id

    def finish_session(self, session_id: str, status: str = "success") -> None:
        """Free what a client session made: its training models and their weight snapshots
        (the sampling sessions on them then answer as expired). The first status is kept."""
        self.sessions.discard(session_id)
        self.finished.setdefault(session_id, status)
        while len(self.finished) > FINISHED_KEPT:
            del self.finished[next(iter(self.finished))]
        prefix = f"{session_id}:"
        for model_id in [m for m in self.models if m.startswith(prefix)]:
            del self.models[model_id]
        self.pool.drop_owned(lambda owner: owner.startswith(prefix))

    def _model(self, model_id: str) -> _Model:
        found = self.models.get(model_id)
        if found is None:
            raise UserError(f"unknown model_id {model_id!r}")
        self.catalog.touch(model_id)
        return found

    async def create_model(self, request: dict[str, Any]) -> Outcome:
        """A new LoRA training model of the requested rank."""
        base_model = self._check_base_model(request.get("base_model"))
        lora = request.get("lora_config") or {}
        if "rank" not in lora:
            raise UserError("the local server trains LoRA models only; give lora_config.rank")
        spec = LoraSpec(
            rank=int(lora["rank"]),
            seed=int(lora.get("seed") or 0),
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        model_id = f"{request['session_id']}:train:{request['model_seq_id']}"
        training = await asyncio.to_thread(TrainingModel, self.base, spec)
        self.models[model_id] = _Model(training=training, base_model=base_model)
        self.catalog.record_run(
            model_id,
            base_model=base_model,
            lora_rank=spec.rank,
            user_metadata=request.get("user_metadata"),
        )
        return json_outcome({"model_id": model_id, "type": "create_model"})

    def get_info(self, model_id: str) -> dict[str, Any]:
        """Model name, tokenizer directory and LoRA rank of a training model."""
        model = self._model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "model_name": model.base_model,
                "tokenizer_id": self.tokenizer_id,
                "arch": type(self.base).__name__,
            },
            "is_lora": True,
            "lora_rank": model.training.lora.rank,
        }

    # -- training -----------------------------------------------------------------------------

    async def forward_backward(self, call: ForwardBackwardCall) -> Outcome:
        """Per-datum logprobs and `loss:sum`; gradients accumulate unless `forward_only`."""
        model = self._model(call.model_id)
        async with model.lock:
            logprobs, metrics = await asyncio.to_thread(
                model.training.forward_backward,
                call.data,
                call.loss_fn,
                call.loss_fn_config,
                forward_only=call.forward_only,
            )
        return Outcome(body=encode_forward_backward_output(logprobs, metrics), media_type=PROTOBUF)

    async def optim_step(self, request: dict[str, Any]) -> Outcome:
        """One AdamW step with the request's `adam_params`."""
        model = self._model(request["model_id"])
        params = request.get("adam_params") or request.get("optim_params")
        if params is None:
            raise UserError("optim_step takes adam_params; other optimizers are not served here")
        fields = AdamSettings.__dataclass_fields__
        settings = AdamSettings(**{k: float(v) for k, v in params.items() if k in fields})
        async with model.lock:
            metrics = await asyncio.to_thread(model.training.optim_step, settings)
        return json_outcome({"type": "optim_step", "metrics": metrics})

    # -- saved state --------------------------------------------------------------------------

    def _path(self, run: str, kind: str, name: str) -> tuple[str, Path]:
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"checkpoint name {name!r} must be a plain name (no '/')")
        return f"tinker://{run}/{kind}/{name}", self.store / run / kind / name

    def _resolve(self, path: str) -> Path:
        self.catalog.sweep()  # an expired checkpoint is gone
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in _KINDS:
            raise UserError(f"{path!r} is not a tinker://<run>/weights/<name> path")
        directory = self.store.joinpath(*parts)
        if not (directory / "meta.json").is_file():
            raise UserError(f"no saved state at {path} (store {self.store})")
        return directory

    async def save_weights(self, request: dict[str, Any], *, kind: str) -> Outcome:
        """Save a model's adapters (and, for `weights`, its optimizer state) under a name."""
        model = self._model(request["model_id"])
        uri, directory = self._path(request["model_id"], kind, request["path"])
        if directory.exists() and not request.get("overwrite", False):
            raise UserError(f"{uri} exists; pass overwrite=True or choose another name")
        async with model.lock:
            await asyncio.to_thread(
                model.training.save,
                directory,
                base_model=model.base_model,
                optimizer=kind == "weights",
            )
        self.catalog.record_checkpoint(
            directory,
            ttl_seconds=request.get("ttl_seconds"),
            user_metadata=request.get("user_metadata"),
        )
        # The SDK's response types name the call, not the kind of saved state.
        return json_outcome({"path": uri, "type": _SAVE_TYPE[kind]})

    async def save_weights_external(self, request: dict[str, Any]) -> Outcome:
        """Export a model as a Hugging Face model directory (adapters merged into the base
        weights, with its tokenizer), encrypted to `age_encryption_recipients` if given
        (`export.py`)."""
        recipients = age_recipients(request.get("age_encryption_recipients"))
        model = self._model(request["model_id"])
        uri, directory = self._path(request["model_id"], "external_weights", request["path"])
        if directory.exists():
            raise UserError(f"{uri} exists; choose another name")
        async with model.lock:
            weights = await asyncio.to_thread(model.training.merged_weights)
        await asyncio.to_thread(
            write_export, self.template, weights, self.tokenizer, directory, recipients
        )
        self.catalog.record_checkpoint(directory, ttl_seconds=request.get("ttl_seconds"))
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        return json_outcome({"path": uri, "size_bytes": size, "type": "save_weights_external"})

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        """Base model and LoRA shape of saved state (`get_weights_info_by_tinker_path`)."""
        meta = TrainingModel.read_meta(self._resolve(tinker_path))
        lora = meta["lora"]
        return {
            "base_model": meta["base_model"],
            "is_lora": True,
            "lora_rank": lora["rank"],
            "train_unembed": lora["train_unembed"],
            "train_mlp": lora["train_mlp"],
            "train_attn": lora["train_attn"],
        }

    async def snapshot_for_sampler(self, request: dict[str, Any]) -> Outcome:
        """The ephemeral save of `save_weights_and_get_sampling_client`: a new sampling session."""
        model = self._model(request["model_id"])
        async with model.lock:
            weights = await asyncio.to_thread(model.training.merged_weights)
        session_id = self._new_sampling_session_id()
        owner = request["model_id"]
        await asyncio.to_thread(self.pool.add_snapshot, session_id, weights, owner)
        return json_outcome({"sampling_session_id": session_id, "type": "save_weights_for_sampler"})

    async def load_weights(self, request: dict[str, Any]) -> Outcome:
        """A training model restored from saved state (with its optimizer state if asked)."""
        directory = self._resolve(request["path"])
        meta = TrainingModel.read_meta(directory)
        base_model = self._check_base_model(request.get("base_model") or meta["base_model"])
        if request.get("model_id"):
            model_id = request["model_id"]
        else:
            model_id = f"{request['session_id']}:train:{request['model_seq_id']}"

        def build() -> TrainingModel:
            training = TrainingModel(self.base, LoraSpec(**meta["lora"]))
            training.load(directory, optimizer=bool(request.get("optimizer")))
            return training

        training = await asyncio.to_thread(build)
        self.models[model_id] = _Model(training=training, base_model=base_model)
        self.catalog.record_run(
            model_id,
            base_model=base_model,
            lora_rank=training.lora.rank,
            user_metadata=request.get("user_metadata"),
        )
        return json_outcome({"path": request["path"], "model_id": model_id, "type": "load_weights"})

    # -- sampling -----------------------------------------------------------------------------

    def _new_sampling_session_id(self) -> str:
        self._sampling_sessions += 1
        return f"sampler-{uuid.uuid4().hex[:8]}-{self._sampling_sessions}"

    async def create_sampling_session(self, request: dict[str, Any]) -> str:
        """A sampling session on the base model or on saved weights (`model_path`)."""
        session_id = self._new_sampling_session_id()
        path = request.get("model_path")
        if path is None:
            self._check_base_model(request.get("base_model"))
            await asyncio.to_thread(self.pool.add_base, session_id)
            return session_id
        directory = self._resolve(path)
        meta = TrainingModel.read_meta(directory)

        def merged() -> dict[str, Any]:
            training = TrainingModel(self.base, LoraSpec(**meta["lora"]))
            training.load(directory, optimizer=False)
            return training.merged_weights()

        await asyncio.to_thread(self.pool.add_snapshot, session_id, await asyncio.to_thread(merged))
        return session_id

    async def sample(self, request: dict[str, Any]) -> Outcome:
        """`num_samples` completions of the prompt, batched with concurrent requests."""
        session_id = request.get("sampling_session_id")
        if session_id is None:
            raise UserError("asample needs a sampling_session_id (create a SamplingClient)")
        prompt_ids: list[int] = []
        for chunk in request["prompt"]["chunks"]:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"prompt chunk type {chunk.get('type')!r}: text only")
            prompt_ids += chunk["tokens"]
        for key, why in _SAMPLE_REFUSED.items():
            if request.get(key):
                raise UserError(f"asample {key}: {why}")
        sequences, prompt_logprobs, topk = await self.pool.sample(
            session_id,
            prompt_ids,
            int(request.get("num_samples", 1)),
            request.get("sampling_params") or {},
            prompt_logprobs=bool(request.get("prompt_logprobs")),
            topk_prompt=int(request.get("topk_prompt_logprobs") or 0),
        )
        body = encode_sample_response(sequences, prompt_logprobs, topk)
        return Outcome(body=body, media_type=PROTOBUF)
