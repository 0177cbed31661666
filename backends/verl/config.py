"""Our run config in verl's terms: the `verl:` section, Hydra overrides, verl's own validation.

`hydra_overrides` translates the keys we own (model, batch, loss, optimizer, placement) into
dotted overrides of verl's `ppo_trainer` config; `verl.extra_overrides` appends other keys that
reach verl's workers verbatim (one that would do nothing, or that unified sets, is refused).
`compose_verl_config` composes them with verl's Hydra config tree and runs verl's
`validate_config`, so a run that starts is one verl accepts. A key verl no longer has (removed or
renamed upstream) is a `ConfigError` naming the key, with the known replacement when there is one.
`training_worker_config` builds the `TrainingWorkerConfig` of verl's engine workers from it, and
`reference_worker_config` that of the frozen reference (when `trainer.kl_coef > 0`), as
`ActorRolloutRefWorker.init_model` does.

The async-mode keys (`trainer.v1.*`) say our loop in verl's words: verl validates them and the
composed config records them; unified's coordinator, not verl's trainer, enforces the staleness.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.verl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_LOSS_TYPE,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
)
from torchkit.vllm_settings import VllmSettings
from unified.config import TrainerConfig, backend_section
from unified.errors import CapabilityError, ConfigError

__all__ = [
    "EFFECTIVE_PREFIXES",
    "OWNED_KEYS",
    "RENAMED_KEYS",
    "VerlConfig",
    "compose_verl_config",
    "hydra_overrides",
    "parse_verl_config",
    "reference_worker_config",
    "training_worker_config",
]

log = logging.getLogger(__name__)

VERL_VERSION = "0.9.1"

# verl keys that existed in earlier releases: what became of them.
RENAMED_KEYS: dict[str, str] = {
    "use_legacy_worker_impl": "removed in verl 0.9 (the engine workers are the only workers)",
}


# What reaches verl's workers: the model, actor and reference sections and the log-prob passes.
# The rest of verl's config (`algorithm`, `data`, `trainer`, `critic`, the rollout servers)
# drives verl's own trainer, which unified replaces: an override there would do nothing.
EFFECTIVE_PREFIXES = (
    "actor_rollout_ref.model.",
    "actor_rollout_ref.actor.",
    "actor_rollout_ref.ref.",
    "actor_rollout_ref.rollout.log_prob_",
)

# Keys under those that unified sets from its own config, and why (or what to set instead).
_ACTOR = "actor_rollout_ref.actor."
OWNED_KEYS: dict[str, str] = {
    "actor_rollout_ref.model.path": "use model",
    "actor_rollout_ref.model.override_config.attn_implementation": "use verl.attn_implementation",
    _ACTOR + "ppo_mini_batch_size": "use trainer.batch_size (one update per step, whole batch)",
    _ACTOR + "ppo_epochs": "the trainer makes one update per step",
    _ACTOR + "shuffle": "the trainer makes one update per step",
    _ACTOR + "data_loader_seed": "use trainer.seed",
    _ACTOR + "ppo_micro_batch_size_per_gpu": "use verl.forward_batch_size",
    _ACTOR + "loss_agg_mode": "use trainer.loss_agg",
    _ACTOR + "entropy_coeff": "use trainer.entropy_coef",
    _ACTOR + "use_kl_loss": "use trainer.kl_coef",
    _ACTOR + "kl_loss_coef": "use trainer.kl_coef",
    _ACTOR + "optim.lr": "use trainer.lr (the trainer schedules it every step)",
    _ACTOR + "optim.weight_decay": "use trainer.optimizer.weight_decay",
    _ACTOR + "optim.betas": "use trainer.optimizer.betas",
    _ACTOR + "optim.clip_grad": "use trainer.optimizer.max_grad_norm",
    _ACTOR + "optim.override_optimizer_config.eps": "use trainer.optimizer.eps",
    _ACTOR + "optim.total_training_steps": "use trainer.total_steps",
    **{
        _ACTOR + f"optim.{key}": "use trainer.lr_schedule and trainer.warmup_steps (the trainer "
        "sets the lr every step; verl's scheduler never steps)"
        for key in (
            "lr_warmup_steps",
            "lr_warmup_steps_ratio",
            "lr_scheduler_type",
            "min_lr_ratio",
            "num_cycles",
            "warmup_style",
        )
    },
    _ACTOR + "strategy": "use verl.strategy",
    _ACTOR + "kl_loss_type": "use verl.kl_clamp (every backend's KL term is k3; 10: low_var_kl)",
    _ACTOR + "calculate_entropy": "the trainer asks for entropy with each call",
    _ACTOR + "checkpoint.save_contents": "a resume needs model, optimizer and extra",
    _ACTOR + "policy_loss.loss_mode": "use trainer.loss",
    _ACTOR + "clip_ratio": "use trainer.clip_ratio",
    _ACTOR + "clip_ratio_low": "use trainer.clip_ratio",
    _ACTOR + "clip_ratio_high": "use trainer.clip_ratio",
    _ACTOR + "clip_ratio_c": "use verl.dual_clip_ratio",
    _ACTOR + "fsdp_config.mixed_precision": "use verl.param_dtype",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision": "use verl.param_dtype",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "use verl.forward_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "use verl.forward_batch_size",
}


class VerlConfig(BaseModel):
    """`verl:` — settings of the verl backend (the rest of the run comes from the shared keys)."""

    model_config = ConfigDict(extra="forbid")
    moved_keys: ClassVar[dict[str, str]] = {
        "micro_batch_size": "verl.forward_batch_size",
        "loss_agg": "trainer.loss_agg",
        "betas": "trainer.optimizer.betas",
        "weight_decay": "trainer.optimizer.weight_decay",
        "max_grad_norm": "trainer.optimizer.max_grad_norm",
    }

    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto' or host:port, after `ray start` on each node); "
        "null starts a private Ray on 127.0.0.1.",
    )
    num_workers: int = Field(
        2,
        ge=1,
        description="Training worker processes (data parallel); one GPU each on a GPU machine.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the workers train: cuda when a GPU is visible, else cpu."
    )
    strategy: Literal["fsdp2", "fsdp"] = Field("fsdp2", description="verl's FSDP engine version.")
    forward_batch_size: int = Field(8, ge=1, description="Sequences per forward pass per worker.")
    dual_clip_ratio: float | None = Field(
        None, gt=1, description="verl's dual-clip bound for negative advantages (null: off)."
    )
    kl_clamp: float | None = Field(
        None,
        gt=0,
        description="Clamp of the KL term's value per token (10: verl's own low_var_kl, under "
        "which the countdown collapsed); null: none, as the local backend's default.",
    )
    param_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="FSDP compute dtype (default: fp32 on cpu, verl's bf16 on cuda)."
    )
    attn_implementation: str = Field("sdpa", description="Hugging Face attention kernel.")
    engine: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="What samples: the built-in sampler, or vLLM's engine in process "
        "(`verl.vllm`; docs/engines.md); the workers' weights go to it at every sync.",
    )
    vllm: VllmSettings = Field(
        default_factory=VllmSettings, description="The vLLM engine's settings (engine: vllm)."
    )
    max_batch: int = Field(64, ge=1, description="Most requests the local sampler batches.")
    prefix_cache_mb: float = Field(
        256,
        ge=0,
        description="The local sampler's memory for finished requests' keys and values, reused "
        "by prompts that extend them (as `local.prefix_cache_mb`); 0: off.",
    )
    call_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Seconds one worker-group call may take before it fails (the calls run on "
        "one daemon thread: one stuck past it is abandoned and does not hold the process's exit).",
    )
    extra_overrides: list[str] = Field(
        default_factory=list,
        description="Hydra overrides of verl's ppo_trainer config, applied last (key=value); "
        "only keys that reach verl's workers (actor_rollout_ref.model/actor/ref, "
        "actor_rollout_ref.rollout.log_prob_*), e.g. "
        "actor_rollout_ref.model.enable_gradient_checkpointing=True.",
    )

    @field_validator("extra_overrides")
    @classmethod
    def _only_effective(cls, overrides: list[str]) -> list[str]:
        for item in overrides:
            _refuse_renamed(item)
            key = item.split("=", 1)[0].lstrip("+~")
            if key in OWNED_KEYS:
                raise ValueError(f"{key} is unified's to set: {OWNED_KEYS[key]}")
            inside = [owned for owned in OWNED_KEYS if owned.startswith(key + ".")]
            if inside:
                raise ValueError(
                    f"{key} would replace keys unified sets ({inside[0]}, ...); override the "
                    "keys inside it one by one"
                )
            if not key.startswith(EFFECTIVE_PREFIXES):
                raise ValueError(
                    f"{key} would have no effect: unified runs the loop, advantages and "
                    "sampling itself; only actor_rollout_ref.model/actor/ref and "
                    "rollout.log_prob_* keys reach verl's workers"
                )
        return overrides


def parse_verl_config(config: TrainerConfig) -> VerlConfig:
    """The `verl:` section, validated; errors name the dotted key."""
    return backend_section(VerlConfig, config, "verl")


def resolved_device(settings: VerlConfig) -> Literal["cpu", "cuda"]:
    """The device the workers train on."""
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolved_param_dtype(settings: VerlConfig) -> Literal["fp32", "bf16"]:
    """The workers' forward dtype: `param_dtype`, else fp32 on CPU and verl's bf16 on a GPU."""
    return settings.param_dtype or ("fp32" if resolved_device(settings) == "cpu" else "bf16")


def hydra_overrides(config: TrainerConfig, settings: VerlConfig, model_dir: Path) -> list[str]:
    """Dotted overrides of verl's `ppo_trainer` config that describe this run."""
    t = config.trainer
    loss = POLICY_LOSSES.get(t.loss)
    if loss is None:
        supported = ", ".join(sorted(POLICY_LOSSES))
        raise CapabilityError(
            f"trainer.loss={t.loss!r} is not supported by backend 'verl'; it supports: {supported}"
        )
    if t.loss_agg not in LOSS_AGGREGATIONS:
        supported = ", ".join(sorted(LOSS_AGGREGATIONS))
        raise CapabilityError(
            f"trainer.loss_agg={t.loss_agg!r} is not supported by backend 'verl'; it supports: "
            f"{supported}"
        )
    device = resolved_device(settings)
    dtype = resolved_param_dtype(settings)
    actor = {
        "strategy": settings.strategy,
        "ppo_mini_batch_size": t.batch_size,
        "ppo_micro_batch_size_per_gpu": settings.forward_batch_size,
        "use_dynamic_bsz": False,
        "ppo_epochs": 1,
        "shuffle": False,
        "data_loader_seed": t.seed,
        "loss_agg_mode": LOSS_AGGREGATIONS[t.loss_agg],
        "entropy_coeff": t.entropy_coef,
        "calculate_entropy": True,
        "use_kl_loss": t.kl_coef > 0,
        "kl_loss_coef": t.kl_coef,
        "kl_loss_type": KL_LOSS_TYPE,
        "use_torch_compile": device == "cuda",
        "fsdp_config.use_torch_compile": device == "cuda",
        "optim.lr": t.lr,
        "optim.weight_decay": t.optimizer.weight_decay,
        "optim.betas": f"[{t.optimizer.betas[0]},{t.optimizer.betas[1]}]",
        "optim.clip_grad": t.optimizer.max_grad_norm,
        "optim.override_optimizer_config": f"{{eps:{t.optimizer.eps!r}}}",
        "optim.total_training_steps": t.total_steps,
        "checkpoint.save_contents": "[model,optimizer,extra]",
        **loss.actor_settings(t.clip_ratio, settings.dual_clip_ratio),
    }
    precision = f"{{param_dtype:{dtype},reduce_dtype:fp32,buffer_dtype:fp32}}"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"+actor_rollout_ref.model.override_config.attn_implementation={settings.attn_implementation}",
        *(f"actor_rollout_ref.actor.{key}={value}" for key, value in actor.items()),
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={precision}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={settings.forward_batch_size}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
        f"actor_rollout_ref.rollout.n={t.group_size}",
        # verl's validation wants a rollout engine name; ours samples with the local sampler.
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.temperature={config.sampling.train.temperature}",
        f"actor_rollout_ref.rollout.top_p={config.sampling.train.top_p}",
        f"actor_rollout_ref.rollout.response_length={config.sampling.train.max_tokens}",
        "algorithm.rollout_correction.bypass_mode=True",
        # Advantages come from the trainer (unified.advantages); no value model.
        "critic.enable=False",
        f"data.train_batch_size={t.batch_size}",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={settings.num_workers}",
        f"trainer.device={device}",
        "trainer.logger=[console]",
        "trainer.project_name=unified",
        f"trainer.experiment_name={config.name}",
        f"trainer.total_training_steps={t.total_steps}",
        f"trainer.save_freq={t.save_every or -1}",
        "trainer.val_before_train=False",
    ]
    if t.kl_coef > 0:
        # The reference scores like the policy does, and never trains (verl's `ref` role).
        overrides += [
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={settings.forward_batch_size}",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=False",
            f"actor_rollout_ref.ref.use_torch_compile={device == 'cuda'}",
            f"actor_rollout_ref.ref.fsdp_config.use_torch_compile={device == 'cuda'}",
            f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={precision}",
        ]
    estimator = ADVANTAGE_ESTIMATORS[t.advantage]
    if estimator is not None:
        name, kwargs = estimator
        overrides.append(f"algorithm.adv_estimator={name}")
        overrides += [f"algorithm.{key}={value}" for key, value in kwargs.items()]
    if config.mode == "async":
        overrides += [
            "trainer.v1.trainer_mode=colocate_async",
            f"trainer.v1.sampler.max_off_policy_threshold={config.async_.max_staleness}",
            "trainer.v1.sampler.max_off_policy_strategy=wait",
        ]
    return overrides + list(settings.extra_overrides)


def compose_verl_config(overrides: list[str]) -> Any:
    """verl's `ppo_trainer` config with `overrides`, resolved and validated by verl itself."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    if verl.__version__ != VERL_VERSION:
        raise ConfigError(
            f"the verl backend is built for verl {VERL_VERSION}, found {verl.__version__}; "
            f"pip install 'verl=={VERL_VERSION}'"
        )
    for item in overrides:
        _refuse_renamed(item)
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            composed = compose("ppo_trainer", overrides=overrides)
    except ConfigCompositionException as e:
        raise ConfigError(f"verl {VERL_VERSION} rejects an override: {_one_line(e)}") from e
    OmegaConf.resolve(composed)
    printed = io.StringIO()  # verl prints its notices and a success line on stdout
    with verl_checks(), contextlib.redirect_stdout(printed):
        validate_config(
            composed,
            use_reference_policy=need_reference_policy(composed),
            use_critic=need_critic(composed),
        )
    for line in printed.getvalue().splitlines():
        if line.strip() and "checks passed" not in line:
            log.warning("verl's validate_config: %s", line.strip())
    return composed


@contextlib.contextmanager
def verl_checks() -> Iterator[None]:
    """verl's own checks of a config (its dataclasses' and `validate_config`'s) as one-line
    `ConfigError`s; verl builds its dataclasses through Hydra, so their checks arrive wrapped."""
    from hydra.errors import InstantiationException

    try:
        yield
    except (AssertionError, ValueError, InstantiationException) as e:
        raise ConfigError(f"verl's config validation failed: {_one_line(e)}") from e


def _one_line(error: Exception) -> str:
    """Hydra's multi-line message as one line, led by the key it names."""
    text = str(error.__cause__ or error)
    key = re.search(r"full_key: (\S+)", text)
    first = text.strip().splitlines()[0]
    return f"{key.group(1)}: {first}" if key else first


def _refuse_renamed(override: str) -> None:
    key = override.split("=", 1)[0].lstrip("+~")
    for old, fate in RENAMED_KEYS.items():
        if key == old or key.endswith("." + old):
            raise ConfigError(f"verl key {key!r} is not in verl {VERL_VERSION}: {fate}")


def training_worker_config(composed: Any) -> tuple[Any, Any]:
    """(`TrainingWorkerConfig`, actor config) for the policy, as verl's actor worker builds them."""
    from verl.utils.config import omega_conf_to_dataclass

    section = composed.actor_rollout_ref
    with verl_checks():
        model_config = omega_conf_to_dataclass(section.model)
        actor_config = omega_conf_to_dataclass(section.actor)
    actor_config.model_config = model_config
    worker_config = _worker_config(
        model_config,
        actor_config,
        dynamic_bsz=section.actor.use_dynamic_bsz,
        infer_max_tokens=section.rollout.log_prob_max_token_len_per_gpu,
        infer_micro_batch=section.rollout.log_prob_micro_batch_size_per_gpu,
    )
    engine = worker_config.engine_config
    engine.max_token_len_per_gpu = section.actor.ppo_max_token_len_per_gpu
    engine.micro_batch_size_per_gpu = section.actor.ppo_micro_batch_size_per_gpu
    return worker_config, actor_config


def reference_worker_config(composed: Any) -> Any | None:
    """The frozen reference's `TrainingWorkerConfig` (None without a KL loss), as verl builds it.

    `ActorRolloutRefWorker.init_model` step 1: the `ref` section with its `log_prob_*` keys moved
    to the actor's names, the policy's model, a forward-only FSDP engine and no optimizer.
    """
    from copy import deepcopy

    from omegaconf import OmegaConf, open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import MtpConfig

    section = composed.actor_rollout_ref
    if not section.actor.use_kl_loss:
        return None
    ref = OmegaConf.create(OmegaConf.to_container(section.ref))
    with open_dict(ref):
        ref.ppo_mini_batch_size = section.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    with verl_checks():
        model_config = deepcopy(omega_conf_to_dataclass(section.model))
        ref_config = omega_conf_to_dataclass(ref)
    model_config.mtp = MtpConfig(enable=False)
    return _worker_config(
        model_config,
        ref_config,
        dynamic_bsz=ref.use_dynamic_bsz,
        infer_max_tokens=ref.ppo_max_token_len_per_gpu,
        infer_micro_batch=ref.ppo_micro_batch_size_per_gpu,
    )


def _worker_config(
    model_config: Any,
    role_config: Any,
    *,
    dynamic_bsz: bool,
    infer_max_tokens: int | None,
    infer_micro_batch: int | None,
) -> Any:
    """verl's `TrainingWorkerConfig` of a language model from a role's (actor/ref) config."""
    from verl.workers.config import TrainingWorkerConfig

    worker_config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=role_config.engine,
        optimizer_config=role_config.optim,
        checkpoint_config=role_config.checkpoint,
        profiler_config=None,
    )
    engine = worker_config.engine_config
    engine.use_dynamic_bsz = dynamic_bsz
    engine.infer_max_token_len_per_gpu = infer_max_tokens
    engine.infer_micro_batch_size_per_gpu = infer_micro_batch
    engine.use_remove_padding = model_config.get("use_remove_padding", False)
    return worker_config
