"""The interfaces between the trainer and the world: `BackendProtocol`, its `TokenSampler`, and
the `RolloutEngine` workflows see.

A backend trains the policy and serves it for sampling on token ids (`token_sampler()`); the
trainer owns the policy version and tells the backend when version `v` must become visible to
sampling (`on_policy_updated`). A workflow sees only a `RolloutEngine`, which the core builds over
the backend's sampler (`unified.rollout.SamplingEngine`): chat templating happens there, once, for
every backend. Every sampling setting is passed per request, so train and eval requests never
share a mutable engine-wide mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from unified.config import LOSS_AGGREGATIONS
from unified.types import ModelOutput, SamplingParams, TrajectoryGroup

if TYPE_CHECKING:
    from unified.config import TrainerConfig

__all__ = [
    "ALL_ADVANTAGES",
    "ALL_LOSSES",
    "DEFAULT_TIS_CAP",
    "BackendCapabilities",
    "BackendProtocol",
    "ChatTokenizer",
    "RolloutEngine",
    "RunStatus",
    "TokenSampler",
    "Tokenizer",
    "backend_class",
    "check_capabilities",
    "create_backend",
    "resolve_partial_rollout",
    "resolve_tis_cap",
    "with_partial_rollout",
]

ALL_LOSSES = frozenset({"cross_entropy", "importance_sampling", "ppo", "cispo"})
ALL_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce"})
DEFAULT_TIS_CAP = 2.0  # what trainer.tis_cap "auto" means in async mode
RunStatus = Literal["success", "errored", "interrupted"]
"""How a command ended, as `BackendProtocol.set_outcome` is told (tinker's finish reasons)."""


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a tokenizer a workflow may rely on (Hugging Face tokenizers fit it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ChatTokenizer(Protocol):
    """A backend's tokenizer as the core uses it: prompts are rendered with its chat template
    (`unified.chat`), and workflows get it as their `Tokenizer`. Hugging Face tokenizers fit it
    (their `decode` is typed for batches too, so they are not a `Tokenizer` to a type checker).
    """

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tokenize: bool,
        return_dict: bool,
        **kwargs: Any,
    ) -> Any: ...


class TokenSampler(Protocol):
    """What a backend serves for sampling: its tokenizer, and completions of token ids.

    The core applies the chat template with `tokenizer` and fills in every sampling setting
    (train or eval settings, the request's seed) before calling `sample`; a backend (the local
    sampler, a remote service, an inference engine) only samples. A cancelled `sample` should
    stop sampling for that request.
    """

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The policy's tokenizer, chat template included."""
        ...

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        """One completion of `prompt_ids` under `params` (read-only), from the policy version
        last made visible, stamped with that version in `ModelOutput.policy_version`."""
        ...


class RolloutEngine(ABC):
    """What a workflow sees of the policy: a tokenizer and two async sampling calls.

    `sampling` keywords are those of `unified.types.SamplingParams`; the trainer hands workflows
    the core's engine (`unified.rollout.SamplingEngine`) that fills in the train or eval settings
    and samples on the backend's `TokenSampler`.
    """

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The policy's tokenizer."""

    @abstractmethod
    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ModelOutput:
        """Apply the chat template to `messages` and sample one assistant reply."""

    @abstractmethod
    async def complete(self, prompt_ids: list[int], **sampling: Any) -> ModelOutput:
        """Sample a continuation of raw token ids."""

    @property
    def sampling_defaults(self) -> SamplingParams:
        """The settings a request gets unless it overrides them (the run's train or eval ones)."""
        return SamplingParams()

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of `messages` (and the OpenAI function `tools` declared to the model) under
        the chat template (what `chat` sends to the model)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its chat template")


class BackendCapabilities(BaseModel):
    """What a backend can honour; a config knob outside it is an error at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    losses: frozenset[str] = Field(ALL_LOSSES, description="Loss names forward_backward accepts.")
    advantages: frozenset[str] = Field(ALL_ADVANTAGES, description="Advantage estimators allowed.")
    partial_rollout: bool = Field(
        False, description="Requests may keep running across a weight sync (abort and resume)."
    )
    truncated_is: bool = Field(
        False, description="Honours trainer.tis_cap (truncated importance sampling)."
    )
    loss_aggregations: frozenset[str] = Field(
        LOSS_AGGREGATIONS, description="trainer.loss_agg modes honoured."
    )
    scoring_temperature: Literal["per_sequence", "per_step", "one"] = Field(
        "per_sequence",
        description="Which scoring temperatures (`unified.sequences.scoring_temperature`) it "
        "honours: each sequence its own; one per optimizer step (a step that mixes them is an "
        "error); only 1 (sampling.train.temperature must be 1 for policy losses).",
    )
    unclipped_gradients: bool = Field(
        True, description="Honours trainer.optimizer.max_grad_norm=null (no clipping)."
    )
    kl_penalty: bool = Field(True, description="Honours trainer.kl_coef > 0.")
    entropy_bonus: bool = Field(True, description="Honours trainer.entropy_coef > 0.")
    adaptive_entropy: bool = Field(
        False,
        description="Honours trainer.entropy_target: `set_entropy_coef` changes the bonus's "
        "coefficient between steps.",
    )
    lr_schedules: frozenset[str] = Field(
        frozenset({"constant", "linear", "cosine", "wsd"}), description="Learning-rate schedules."
    )
    max_concurrency: int | None = Field(
        None, description="Most concurrent sampling requests the backend can serve, if bounded."
    )


class BackendProtocol(ABC):
    """A training backend: trains on groups, and serves the current policy for sampling.

    Call order: `setup` once; then any number of (`forward_backward`+ `optim_step`) with
    `on_policy_updated(v)` after every `sync_every` optimizer steps; `shutdown` always, last.
    `forward_backward` may be called several times before one `optim_step` (streamed gradient
    accumulation). Implementations run blocking work off the event loop (`asyncio.to_thread`).
    """

    name: ClassVar[str]
    capabilities: BackendCapabilities = BackendCapabilities()

    @abstractmethod
    async def setup(self, config: TrainerConfig) -> None:
        """Load the model, optimizer and sampler; called once before anything else."""

    @abstractmethod
    def token_sampler(self) -> TokenSampler:
        """What samples from the policy version last made visible (after `setup`)."""

    @abstractmethod
    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """Accumulate the loss gradient of `groups`; return metrics such as `train/loss`."""

    @abstractmethod
    async def optim_step(self) -> dict[str, float]:
        """Apply the accumulated gradient (one optimizer step) and clear it."""

    @abstractmethod
    async def on_policy_updated(self, version: int) -> None:
        """Weight sync: make the trained weights visible to sampling as policy `version`."""

    @abstractmethod
    async def save_checkpoint(self, directory: Path) -> None:
        """Write the backend's state (weights, optimizer, RNG) into an existing directory."""

    @abstractmethod
    async def load_checkpoint(self, directory: Path) -> None:
        """Restore the state `save_checkpoint` wrote."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Release every resource; called once, also after an error."""

    def set_learning_rate(self, lr: float) -> None:  # noqa: B027 - optional hook
        """Use `lr` for the next `optim_step`; the trainer calls it with the scheduled value."""

    def set_entropy_coef(self, coef: float) -> None:  # noqa: B027 - optional hook
        """Weigh the entropy bonus by `coef` from the next `forward_backward` on; the trainer
        calls it before the first step and after each under `trainer.entropy_target`
        (capability `adaptive_entropy`)."""

    def will_load_checkpoint(self) -> None:  # noqa: B027 - optional hook
        """Told before `setup` when `load_checkpoint` follows it (a resume, an evaluation of a
        checkpoint): a backend can then skip making fresh state that the load would replace."""

    def set_outcome(self, status: RunStatus, detail: str | None = None) -> None:  # noqa: B027
        """How the command ended, told just before `shutdown`, so a remote service can record
        it (tinker's session finish reason). Optional: the default ignores it."""

    async def export_model(self, directory: Path) -> None:
        """Write the trained policy where users can load it (e.g. a Hugging Face directory)."""
        raise NotImplementedError(f"backend {self.name!r} cannot export its model")

    def resolve_config(self, config: TrainerConfig) -> TrainerConfig:
        """`config` with what this backend decides from the environment written in (e.g.
        tinker's `service: auto` as `remote` or `offline`), so the run's `config.yaml` records
        it. The default changes nothing."""
        return config

    def check_config(self, config: TrainerConfig) -> None:  # noqa: B027 - optional hook
        """Refuse what this backend cannot run in `config` beyond its capabilities: its own
        section (`local:`, `tinker:`, `verl:`) and the model spec. Called at start-up and by
        `--dry-run`; cheap: no model loaded, no server reached. The default accepts it all."""


def create_backend(spec: str) -> BackendProtocol:
    """Instantiate a backend by registry name (entry point group `unified.backends`) or path."""
    return backend_class(spec)()


def backend_class(spec: str) -> type[BackendProtocol]:
    """A backend's class by registry name (entry point group `unified.backends`) or path."""
    from importlib.metadata import entry_points

    from unified.errors import UsageError
    from unified.imports import import_object

    if ":" in spec:
        cls = import_object(spec, what="backend")
    else:
        found = {ep.name: ep for ep in entry_points(group="unified.backends")}
        if spec not in found:
            names = ", ".join(sorted(found)) or "none installed"
            raise UsageError(
                f"unknown backend {spec!r}; registered backends: {names}; "
                "or give an import path like 'package.module:MyBackend'"
            )
        try:
            cls = found[spec].load()
        except ImportError as e:
            raise UsageError(
                f"backend {spec!r} is registered but cannot be imported ({e}); "
                f"install its extra: pip install 'unified[{spec}]'"
            ) from e
    if not (isinstance(cls, type) and issubclass(cls, BackendProtocol)):
        raise UsageError(f"backend {spec!r} is not a BackendProtocol subclass")
    return cls


def check_capabilities(config: TrainerConfig, backend: BackendProtocol) -> None:
    """Raise `CapabilityError` naming the first knob of `config` that `backend` cannot honour,
    then let the backend check its own section and the model (`check_config`)."""
    from unified.errors import CapabilityError

    caps, trainer, async_ = backend.capabilities, config.trainer, config.async_
    name = getattr(backend, "name", type(backend).__name__)

    def refuse(knob: str, value: object, supported: str) -> CapabilityError:
        return CapabilityError(
            f"{knob}={value!r} is not supported by backend {name!r}; {supported}"
        )

    if trainer.loss not in caps.losses:
        raise refuse("trainer.loss", trainer.loss, f"it supports: {', '.join(sorted(caps.losses))}")
    if trainer.advantage not in caps.advantages:
        supported = ", ".join(sorted(caps.advantages))
        raise refuse("trainer.advantage", trainer.advantage, f"it supports: {supported}")
    if trainer.lr_schedule not in caps.lr_schedules:
        supported = ", ".join(sorted(caps.lr_schedules))
        raise refuse("trainer.lr_schedule", trainer.lr_schedule, f"it supports: {supported}")
    if async_.partial_rollout and not caps.partial_rollout:
        raise refuse("async.partial_rollout", True, "set async.partial_rollout=false")
    if isinstance(trainer.tis_cap, float) and not caps.truncated_is:
        raise refuse("trainer.tis_cap", trainer.tis_cap, "set trainer.tis_cap=null or auto")
    if trainer.loss_agg not in caps.loss_aggregations:
        supported = ", ".join(sorted(caps.loss_aggregations))
        raise refuse("trainer.loss_agg", trainer.loss_agg, f"it supports: {supported}")
    temperature = config.sampling.train.temperature
    if caps.scoring_temperature == "one" and trainer.loss != "cross_entropy" and temperature != 1:
        raise refuse(
            "sampling.train.temperature",
            temperature,
            "its losses score tokens at temperature 1; set it to 1.0",
        )
    if trainer.optimizer.max_grad_norm is None and not caps.unclipped_gradients:
        raise refuse(
            "trainer.optimizer.max_grad_norm", None, "it always clips; set a norm (e.g. 1.0)"
        )
    if trainer.kl_coef > 0 and not caps.kl_penalty:
        raise refuse("trainer.kl_coef", trainer.kl_coef, "set trainer.kl_coef=0")
    if trainer.entropy_coef > 0 and not caps.entropy_bonus:
        raise refuse("trainer.entropy_coef", trainer.entropy_coef, "set trainer.entropy_coef=0")
    if trainer.entropy_target is not None and not caps.adaptive_entropy:
        raise refuse(
            "trainer.entropy_target",
            trainer.entropy_target,
            "its entropy coefficient is fixed; set trainer.entropy_target=null",
        )
    if caps.max_concurrency is not None and async_.max_concurrency > caps.max_concurrency:
        raise refuse(
            "async.max_concurrency", async_.max_concurrency, f"its limit is {caps.max_concurrency}"
        )
    check_config = getattr(backend, "check_config", None)  # duck-typed backends may lack it
    if check_config is not None:
        check_config(config)


def resolve_tis_cap(config: TrainerConfig, capabilities: BackendCapabilities) -> float | None:
    """The truncated-IS cap a run uses, `trainer.tis_cap` with "auto" resolved; None when off.

    "auto" is on in async mode (stale and, with partial rollouts, mixed-version tokens) for
    backends that honour it, and off in sync mode and for the supervised loss.
    """
    cap = config.trainer.tis_cap
    if not isinstance(cap, str):
        return cap
    on = (
        config.mode == "async"
        and capabilities.truncated_is
        and config.trainer.loss != "cross_entropy"
    )
    return DEFAULT_TIS_CAP if on else None


def resolve_partial_rollout(config: TrainerConfig, capabilities: BackendCapabilities) -> bool:
    """Whether requests keep running across a weight sync: `async.partial_rollout`, null
    resolved to on in async mode where the backend can (nothing then waits for the old weights,
    and a long request's later tokens come from newer ones), off elsewhere."""
    chosen = config.async_.partial_rollout
    if chosen is not None:
        return chosen
    return config.mode == "async" and capabilities.partial_rollout


def with_partial_rollout(config: TrainerConfig, backend: BackendProtocol) -> TrainerConfig:
    """`config` with `async.partial_rollout` resolved for `backend` (what the run records)."""
    chosen = resolve_partial_rollout(config, backend.capabilities)
    async_ = config.async_.model_copy(update={"partial_rollout": chosen})
    return config.model_copy(update={"async_": async_})
