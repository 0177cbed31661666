"""The run configuration: one pydantic model tree, loaded from YAML plus dotted overrides.

Every key has a default except `workflow`; a misspelt key is an error that lists the valid keys.
`load_config("run.yaml", ["trainer.batch_size=16", "async.max_staleness=2"])` is what the CLI
does; `UnifiedTrainer` accepts a `TrainerConfig`, a dict of the same shape, or a YAML path.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from unified.errors import ConfigError
from unified.redaction import redact_config
from unified.retry import RetryPolicy
from unified.types import SamplingParams

__all__ = [
    "LOSS_AGGREGATIONS",
    "AsyncConfig",
    "DataConfig",
    "LoggingConfig",
    "OptimizerSection",
    "RetrySection",
    "RolloutConfig",
    "SamplingConfig",
    "TrainerConfig",
    "TrainerSection",
    "apply_overrides",
    "load_config",
    "refuse_moved_keys",
]

LossAggregation = Literal["token_mean", "token_sum", "seq_mean_token_mean", "seq_mean_token_sum"]
LOSS_AGGREGATIONS: frozenset[str] = frozenset(get_args(LossAggregation))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class RetrySection(_Section):
    """`trainer.retry:` — retries of the trainer's backend calls that are safe to repeat.

    A call is retried only after a transient error (`TransientBackendError`: timeouts, HTTP 5xx
    and 429); `forward_backward` and `optim_step` never are (a repeat would apply twice).
    """

    on_policy_updated: RetryPolicy = Field(
        default_factory=RetryPolicy, description="The weight sync."
    )
    save_checkpoint: RetryPolicy = Field(
        default_factory=RetryPolicy, description="Writing the backend's part of a checkpoint."
    )
    load_checkpoint: RetryPolicy = Field(
        default_factory=RetryPolicy, description="Reading it back on resume."
    )


class OptimizerSection(_Section):
    """`trainer.optimizer:` — AdamW and gradient clipping, one spelling for every backend."""

    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Gradient clipping norm; null: no clipping."
    )

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas


class TrainerSection(_Section):
    """`trainer:` — the optimization schedule, loss, advantages and fault tolerance."""

    total_steps: int = Field(100, ge=1, description="Optimizer steps to run.")
    max_time_s: float | None = Field(
        None,
        gt=0,
        description="Stop after the step that passes this many seconds of training (then the "
        "final eval and checkpoint run as after the last step).",
    )
    batch_size: int = Field(8, ge=1, description="Groups (tasks) per optimizer step.")
    group_size: int = Field(8, ge=1, description="Rollouts per task.")
    keep_per_group: int | None = Field(
        None,
        ge=2,
        description="Train on this many of each group's rollouts: those whose rewards spread "
        "the most (max-variance down-sampling, PODS), advantages over them. Sampling is often "
        "cheaper than training: the same learning per step for less training compute. Null: all.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Groups per forward_backward call (default: the whole batch). Smaller values "
        "stream: in async mode training starts on the first groups while later ones generate.",
    )
    loss: Literal["cross_entropy", "importance_sampling", "ppo", "cispo"] = Field(
        "ppo", description="Policy loss; ppo (clipped ratio) is the safe choice for async."
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce"] = Field(
        "grpo", description="Group baseline used to turn rewards into advantages."
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine", "wsd"] = Field(
        "constant",
        description="Decay over optimizer steps (not tasks) after warm-up. wsd (warm-up, "
        "stable, decay): the peak rate until the last decay_steps, then linearly to zero.",
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up.")
    decay_steps: int | None = Field(
        None,
        ge=1,
        description="With lr_schedule=wsd: optimizer steps of the final decay (null: the last "
        "fifth of total_steps).",
    )
    clip_ratio: float = Field(0.2, gt=0, description="PPO/CISPO clip range of the ratio.")
    tis_cap: float | Literal["auto"] | None = Field(
        "auto",
        description="Truncated importance sampling of stale tokens: each token's loss is weighted "
        "by min(pi_prox / pi_sampler, tis_cap), pi_prox being the trainer's logprob before the "
        "step. 'auto': 2.0 in async mode where the backend supports it, else off; null: off.",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference.")
    entropy_coef: float = Field(
        0.0, ge=0, description="Weight of the entropy bonus (the first step's, with a target)."
    )
    entropy_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive entropy control (modelled on Skywork-OR1): after each step the "
        "coefficient moves by entropy_coef_step toward keeping train/entropy (nats per sampled "
        "token) at this value: up while below, down while above, within [0, entropy_coef_max]. "
        "Null: entropy_coef stays fixed.",
    )
    entropy_coef_step: float = Field(
        0.005, gt=0, description="How far entropy_target moves the coefficient per step."
    )
    entropy_coef_max: float = Field(
        0.5, gt=0, description="The largest coefficient entropy_target may reach."
    )
    loss_agg: LossAggregation = Field(
        "token_mean",
        description="How token losses aggregate over a step: token_mean (every sampled token "
        "weighs the same), token_sum (Tinker's raw sum), seq_mean_token_mean / "
        "seq_mean_token_sum (each trajectory weighs once, however many turns).",
    )
    optimizer: OptimizerSection = Field(default_factory=lambda: OptimizerSection())
    filter_groups: bool = Field(
        True, description="Drop groups whose rewards are all equal (no learning signal)."
    )
    max_filtered_in_a_row: int = Field(
        256,
        ge=1,
        description="Stop the run when this many groups in a row end filtered or failed: "
        "the reward gives no signal for this policy.",
    )
    eval_every: int = Field(10, ge=0, description="Evaluate every N steps (0: never).")
    eval_before_train: bool = Field(True, description="Evaluate once before the first step.")
    save_every: int = Field(
        20, ge=0, description="Checkpoint every N steps (0: no periodic checkpoints)."
    )
    save_final: bool = Field(
        True,
        description="Checkpoint after the last step, also with save_every 0, so the trained "
        "policy is kept (false: only the save_every ones).",
    )
    seed: int = Field(0, description="Seed for data order and per-request sampling seeds.")
    workflow_timeout_s: float = Field(
        60.0, gt=0, description="Seconds one workflow run may take before it becomes 'timeout'."
    )
    max_error_rate: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Stop and re-raise when this fraction of episodes errors or times out.",
    )
    stall_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds any wait may go without progress (a group changing state, an "
        "episode finishing) before it fails; must exceed workflow_timeout_s.",
    )
    backend_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds one backend call of the trainer (setup, forward_backward, "
        "optim_step, on_policy_updated, checkpoints, shutdown) may take before the run fails "
        "with an error naming the call and the pipeline's state.",
    )
    max_bad_steps: int = Field(
        3,
        ge=0,
        description="Optimizer steps in a row whose loss or gradient norm is NaN/inf (their "
        "update skipped, counted in train/skipped_steps) tolerated; one more stops the run.",
    )
    retry: RetrySection = Field(default_factory=lambda: RetrySection())
    stop_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGINT/SIGTERM, seconds the step in progress may wait for its running "
        "groups before it is abandoned (its tasks are dispatched again on resume).",
    )

    @field_validator("tis_cap")
    @classmethod
    def _cap_at_least_one(cls, cap: float | str | None) -> float | str | None:
        if isinstance(cap, float) and not cap >= 1.0:  # NaN too
            raise ValueError("must be >= 1 (a cap below 1 down-weights on-policy tokens)")
        return cap

    @model_validator(mode="after")
    def _decay_fits_the_run(self) -> TrainerSection:
        if self.decay_steps is None:
            return self
        if self.lr_schedule != "wsd":
            raise ValueError(
                f"trainer.decay_steps ({self.decay_steps}) applies only with "
                f"trainer.lr_schedule=wsd (it is {self.lr_schedule}); remove it or set "
                "trainer.lr_schedule=wsd"
            )
        if self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"trainer.warmup_steps ({self.warmup_steps}) + trainer.decay_steps "
                f"({self.decay_steps}) exceed trainer.total_steps ({self.total_steps}); "
                "shorten them or raise total_steps"
            )
        return self

    @property
    def resolved_decay_steps(self) -> int:
        """`decay_steps`, its default (the last fifth of the run, at least one step) filled in."""
        return self.decay_steps if self.decay_steps is not None else max(1, self.total_steps // 5)


class AsyncConfig(_Section):
    """`async:` — the fully-async loop: staleness bound, weight-sync cadence, concurrency."""

    max_staleness: int = Field(
        1,
        ge=0,
        description="How far generation runs ahead of training, in windows of sync_every steps: "
        "a group is admitted only while the groups admitted and not yet trained fit in the "
        "next 1 + max_staleness windows (a straggler past that, and any group while none is "
        "ready, holds only its running episodes). Nothing is thrown away for being late; each "
        "token keeps the version it was sampled under (metrics lag/token_*). With "
        "strict_staleness: the most versions a trained group may lag behind the weights.",
    )
    strict_staleness: bool = Field(
        False,
        description="A hard per-group bound instead: a group whose oldest token would train "
        "more than max_staleness versions late goes back to the task queue (ledger: requeued), "
        "its generation thrown away; since slow means long, that favours short episodes "
        "(metrics tokens/discarded, length/trained_over_generated).",
    )
    sync_every: int = Field(
        1, ge=1, description="Optimizer steps between weight syncs (both modes)."
    )
    partial_rollout: bool | None = Field(
        None,
        description="Keep requests running across a weight sync, each token stamped with the "
        "version that sampled it, instead of finishing them on the old weights. null: on in "
        "async mode where the backend can (local, verl), off elsewhere (tinker's requests "
        "finish on the snapshot they started on).",
    )
    max_concurrency: int = Field(64, ge=1, description="Most workflows running at once.")
    over_admit: float | None = Field(
        None,
        ge=0,
        description="With strict_staleness only (null there: 2): while workflow slots are free, "
        "admit up to this share of a window's groups beyond what max_staleness holds (the "
        "allowance doubles while the trainer waits on stragglers, and shrinks while groups are "
        "thrown away and it never waits); the trainer then trains the first groups ready and "
        "gives a straggler that misses its deadline back to the task queue. 0: admit only what "
        "the bound holds, and wait for stragglers.",
    )
    dispatch_rate: float | None = Field(
        None, gt=0, description="Most workflow starts per second (e.g. a remote API's limit)."
    )

    @model_validator(mode="after")
    def _over_admit_needs_strict(self) -> AsyncConfig:
        if self.over_admit is not None and not self.strict_staleness:
            raise ValueError(
                f"async.over_admit ({self.over_admit:g}) applies only with "
                "async.strict_staleness=true (by default nothing is thrown away, so nothing is "
                "admitted beyond the bound); remove it or set async.strict_staleness=true"
            )
        return self

    @property
    def resolved_over_admit(self) -> float:
        """`over_admit`, its default (2) filled in: what the strict rule admits beyond it."""
        return 2.0 if self.over_admit is None else self.over_admit


class RolloutConfig(_Section):
    """`rollout:` — where workflows run: in the trainer process, or on Ray actors (workers)."""

    workers: int = Field(
        0,
        ge=0,
        description="Ray actors that run workflows (with their tools and environments); each "
        "calls the policy through the trainer. 0: workflows run in the trainer process.",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join (e.g. 'auto' or 'ray://head:10001'); default: join the "
        "Ray already running in this process, else start a local one.",
    )
    worker_concurrency: int | None = Field(
        None,
        ge=1,
        description="Most workflows one worker runs at once (default: async.max_concurrency "
        "divided among the workers).",
    )
    worker_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per worker.")
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each worker reserves: only nodes started with them "
        "(`ray start --resources='{\"rollout\": 4}'`) run workflows, and the amount a node "
        "has over what a worker takes is how many workers it runs.",
    )
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="pack: Ray's default placement (fill a node first); spread: each worker on "
        "another node where one is free (Ray's SPREAD).",
    )
    max_worker_restarts: int = Field(
        4,
        ge=0,
        description="Dead workers replaced over the run; past it the rest carry on, and the run "
        "stops when none is left.",
    )


class SamplingConfig(_Section):
    """`sampling:` — settings for training rollouts and for evaluation, chosen per request."""

    train: SamplingParams = Field(default_factory=SamplingParams)
    eval: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=0.0))


class DataConfig(_Section):
    """`data:` — where tasks come from: a file path, or `{generator: module:fn, ...kwargs}`."""

    train: str | dict[str, Any] | None = Field(None, description="Training tasks.")
    eval: str | dict[str, Any] | None = Field(None, description="Evaluation tasks.")
    eval_limit: int | None = Field(None, ge=1, description="Evaluate on at most N tasks.")


class LoggingConfig(_Section):
    """`logging:` — the run directory and metric sinks."""

    run_dir: Path = Field(Path("runs"), description="Parent of runs/<name>/.")
    console: bool = Field(True, description="Live progress line on the terminal.")
    jsonl: bool = Field(True, description="Write metrics.jsonl.")
    tensorboard: bool = Field(False, description="Write TensorBoard event files.")
    wandb: bool = Field(False, description="Log to Weights & Biases (offline without a key).")
    wandb_project: str = Field("unified", description="W&B project name.")
    records: bool = Field(
        True,
        description="Write rollout records to runs/<name>/records/: sampled episodes, every "
        "evaluation episode, the timeline of steps (`unified report` shows them).",
    )
    record_every: int = Field(
        64,
        ge=0,
        description="Rollout records: every Nth dispatched group has its episodes written to "
        "runs/<name>/records/, whatever its outcome (1: all; 0: none).",
    )
    record_eval: bool = Field(True, description="Rollout records: every evaluation episode.")
    records_max_mb: float = Field(
        64.0,
        gt=0,
        description="Bound on runs/<name>/records/ (gzip-compressed): files rotate at 1/8 of "
        "it, and the oldest are removed past it.",
    )


class TrainerConfig(_Section):
    """The whole run: what to train, on which backend, how, and where to log."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.\-]+$", description="Run name: runs/<name>.")
    backend: str = Field(
        "local", description="local | tinker | verl, or an import path module:Class."
    )
    mode: Literal["sync", "async"] = Field("sync", description="Training loop.")
    workflow: str = Field(description="Import path of the workflow: module:Class or module:fn.")
    workflow_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the workflow class, given to it for every episode "
        "(e.g. the agent of workflows.agent:AgentWorkflow).",
    )
    model: str = Field(
        "builtin:tiny",
        description="Built-in model (builtin:tiny), local HF directory, a service's model name, "
        "or a model provider module:function that returns a local model directory (built on "
        "first use, cached; resolved once before the backend loads it).",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    resume: bool = Field(False, description="Continue from the newest complete checkpoint.")
    local: dict[str, Any] = Field(default_factory=dict, description="Local backend settings.")
    tinker: dict[str, Any] = Field(default_factory=dict, description="Tinker backend settings.")
    verl: dict[str, Any] = Field(default_factory=dict, description="verl backend settings.")

    @field_validator("name")
    @classmethod
    def _a_directory_name(cls, name: str) -> str:
        if set(name) == {"."}:
            raise ValueError("must name a directory under logging.run_dir, not '.' or '..'")
        return name

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        t = self.trainer
        if t.micro_batch_size is not None and t.micro_batch_size > t.batch_size:
            raise ValueError(
                f"trainer.micro_batch_size ({t.micro_batch_size}) must be <= trainer.batch_size "
                f"({t.batch_size})"
            )
        if t.keep_per_group is not None and t.keep_per_group > t.group_size:
            raise ValueError(
                f"trainer.keep_per_group ({t.keep_per_group}) must be <= trainer.group_size "
                f"({t.group_size})"
            )
        if t.stall_timeout_s <= t.workflow_timeout_s:
            raise ValueError(
                f"trainer.stall_timeout_s ({t.stall_timeout_s:g}) must exceed "
                f"trainer.workflow_timeout_s ({t.workflow_timeout_s:g}): a wait on episodes that "
                "legitimately take that long would fail as a stall; raise trainer.stall_timeout_s"
            )
        if t.entropy_target is not None and t.entropy_coef > t.entropy_coef_max:
            raise ValueError(
                f"trainer.entropy_coef ({t.entropy_coef:g}) starts the adaptive coefficient and "
                f"must be <= trainer.entropy_coef_max ({t.entropy_coef_max:g}); lower it or raise "
                "trainer.entropy_coef_max"
            )
        if t.loss == "cross_entropy" and isinstance(t.tis_cap, float):
            raise ValueError(
                "trainer.tis_cap corrects policy losses; with trainer.loss=cross_entropy set "
                "trainer.tis_cap=null"
            )
        return self

    @property
    def run_path(self) -> Path:
        """The run directory, `<logging.run_dir>/<name>`."""
        return self.logging.run_dir / self.name

    def public_dump(self) -> dict[str, Any]:
        """The resolved config as plain data, `async` under its public name, secrets masked:
        what `config.yaml` and the W&B run record."""
        data: dict[str, Any] = redact_config(self.model_dump(mode="json", by_alias=True))
        return data

    def to_yaml(self) -> str:
        """The resolved config as YAML (`public_dump`)."""
        return yaml.safe_dump(self.public_dump(), sort_keys=False)


SectionT = TypeVar("SectionT", bound=BaseModel)

# Keys that were renamed: the old spelling is refused with one line naming the new key.
RENAMED_KEYS: dict[str, str] = {
    "trainer.workflow_timeout": "trainer.workflow_timeout_s",
    "trainer.stall_timeout": "trainer.stall_timeout_s",
    "trainer.backend_timeout": "trainer.backend_timeout_s",
}


def check_rl_groups(config: TrainerConfig) -> None:
    """Refuse RL groups a group baseline cannot learn from (checked when training starts, not at
    load: `unified sft` reads the same configs and uses no groups)."""
    t = config.trainer
    kept = t.keep_per_group or t.group_size
    if kept < 2 and t.advantage != "reinforce" and t.loss != "cross_entropy":
        raise ConfigError(
            f"trainer.advantage={t.advantage} compares rollouts of a group, and a group trains "
            f"on {kept}: every advantage would be 0; set trainer.group_size (and "
            "trainer.keep_per_group) to 2 or more, or trainer.advantage=reinforce"
        )


def backend_section(model: type[SectionT], config: TrainerConfig, name: str) -> SectionT:
    """A backend's own section (`local:`, `verl:`) validated by `model`; a bad key is a one-line
    `ConfigError` that names it, a moved one (the model's `moved_keys`) names where it went."""
    refuse_moved_keys(getattr(config, name), name, getattr(model, "moved_keys", {}))
    try:
        return model.model_validate(getattr(config, name))
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"config key '{name}.{key}': {first['msg']}") from None


def refuse_moved_keys(section: Mapping[str, Any], name: str, moved: Mapping[str, str]) -> None:
    """A key of section `name` that moved (`moved`: old key -> where it went) is a one-line
    `ConfigError` naming the new key."""
    for old, new in moved.items():
        if old in section:
            raise ConfigError(f"config key '{name}.{old}' has moved: use {new}")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set `a.b.c=value` overrides (values parsed as YAML) into a nested dict, in place."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def load_config(
    source: TrainerConfig | Mapping[str, Any] | str | Path, overrides: Sequence[str] = ()
) -> TrainerConfig:
    """Build a `TrainerConfig` from a model, a dict or a YAML file, then apply `overrides`."""
    if isinstance(source, TrainerConfig):
        if not overrides:
            return source
        raw: dict[str, Any] = source.model_dump(by_alias=True)
    elif isinstance(source, Mapping):
        raw = _deep_copy(source)
    else:
        raw = _read_yaml(Path(source))
    apply_overrides(raw, overrides)
    _refuse_renamed_keys(raw)
    try:
        return TrainerConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def _refuse_renamed_keys(raw: Mapping[str, Any]) -> None:
    for old, new in RENAMED_KEYS.items():
        node: Any = raw
        for part in old.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, Mapping) else _ABSENT
        if node is not _ABSENT:
            raise ConfigError(f"{old} was renamed {new}; write {new}={node!r}")


_ABSENT = object()


def _deep_copy(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder; give a YAML file in it")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from e
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping, got {type(raw).__name__}"
        )
    try:
        json.dumps(raw, default=str, skipkeys=True)  # other keys: validation names them
    except ValueError as e:  # only a cycle: `local: &a {x: *a}`
        raise ConfigError(
            f"config file {str(path)!r} has a YAML alias inside its own anchor ({e}); write "
            "the values out"
        ) from e
    return raw


def _explain(error: ValidationError) -> str:
    """One line per problem, naming the dotted key; unknown keys list the valid ones."""
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            fields = _fields_at(err["loc"][:-1])
            close = difflib.get_close_matches(str(err["loc"][-1]), fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            valid = ", ".join(sorted(fields))
            lines.append(f"unknown config key {loc!r}; {hint}valid keys here: {valid}")
        elif err["type"] == "missing":
            lines.append(f"config key {loc!r} is required")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # A check across keys of a section (or of the whole config): its message names them.
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            got = err.get("input")
            shown = f", got {got!r}" if not isinstance(got, dict | list) else ""
            lines.append(f"config key {loc or '<root>'!r}: {err['msg']}{shown}")
    return "; ".join(lines)


def _fields_at(loc: Sequence[int | str]) -> list[str]:
    model: type[BaseModel] = TrainerConfig
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [f.alias or n for n, f in model.model_fields.items()]


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the schema."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the schema in `unified/config.py`; do not edit by hand. Regenerate with",
        "`python -c 'import unified.config as c; print(c.reference_markdown(), end=\"\")'`.",
        "Every key has a default except `workflow`. Override any key on the command line:",
        "`unified train run.yaml trainer.batch_size=16 async.max_staleness=2`.",
        "",
    ]
    out.extend(schema_tables(TrainerConfig, ""))
    out.extend(
        ["", "## Renamed keys", "", "The old name is refused with a line naming the new one.", ""]
    )
    out.extend(["| old key | new key |", "|---|---|"])
    out.extend(f"| `{old}` | `{new}` |" for old, new in RENAMED_KEYS.items())
    return "\n".join(out) + "\n"


def schema_tables(model: type[BaseModel], prefix: str) -> list[str]:
    """Markdown lines: a table of `model`'s keys (each under `prefix`), then one section per
    nested model. The config reference and the backend sections' tables in docs/ are these."""
    nested: list[tuple[str, type[BaseModel]]] = []
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((key, ann))
            continue
        kind = _type_name(ann).replace("|", "\\|")
        default = (
            "required"
            if field.is_required()
            else repr(field.get_default(call_default_factory=True))
        )
        text = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | `{kind}` | `{default}` | {text} |")
    for key, sub in nested:
        out.extend(["", f"## `{key}`", "", (sub.__doc__ or "").strip(), ""])
        out.extend(schema_tables(sub, f"{key}."))
    return out


def _type_name(ann: Any) -> str:
    """A field's type as a reader writes it: `int | None`, `Literal['cpu', 'cuda']`, `Path`."""
    args = get_args(ann)
    if get_origin(ann) in (Union, UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if get_origin(ann) is Literal:
        return f"Literal[{', '.join(repr(arg) for arg in args)}]"
    if ann is type(None):
        return "None"
    if isinstance(ann, type) and not args:
        return ann.__name__
    return str(ann).replace("typing.", "")
