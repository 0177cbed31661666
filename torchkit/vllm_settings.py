"""The vLLM engine's settings (`vllm:` in a backend's config): their checks against the model
and this machine, and what they become for vLLM (engine arguments, and the environment its
engine processes start with). No vLLM import here: a config is checked without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from unified.errors import ConfigError

__all__ = [
    "MAX_PROMPT_TOP_K",
    "VllmSettings",
    "check_settings",
    "engine_arguments",
    "engine_devices",
    "engine_environment",
    "model_positions",
    "one_line",
]

MAX_PROMPT_TOP_K = 20
"""Most top-k prompt logprobs per position the engine serves (vLLM's `max_logprobs`)."""

_RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# torch's CPU allocator asks for transparent huge pages for its large tensors when this is 1.
_HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"

SMALL_MACHINE_CORES = 4
"""At most this many cores, vLLM's CPU engine runs its model threads on all of them (below)."""


class VllmSettings(BaseModel):
    """`vllm:` — settings of the vLLM engine a backend samples on."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations of the engine (float16 needs a GPU)."
    )
    kv_cache_gb: float | None = Field(
        1.0,
        gt=0,
        description="KV-cache memory in GiB; null: a share of the device's memory "
        "(`memory_fraction`) instead.",
    )
    memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's gpu_memory_utilization, used when kv_cache_gb is null; on CPU a "
        "share of the NUMA node's memory (vLLM's default 0.92 is refused there).",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Most tokens per sequence; default: the model's positions."
    )
    enforce_eager: bool = Field(
        True, description="Eager mode; false: compiled graphs (slow start, faster decode)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Devices one engine spans.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests decoded together.")
    seed: int = Field(0, description="The engine's seed (requests without a seed).")
    cpu_reserved_cores: int | None = Field(
        None,
        ge=0,
        description="On CPU, cores kept free of the engine's model threads (vLLM's "
        "VLLM_CPU_NUM_OF_RESERVED_CPU); null: none on a machine of at most 4 cores, else "
        "vLLM's default (one, for its scheduler). On 2 cores, one left idle cost a third of "
        "the engine's speed (docs/engines.md).",
    )
    weight_transfer: Literal["shared_memory", "nccl", "ipc"] = Field(
        "shared_memory",
        description="How weights reach the engine: shared_memory (CPU, in-place reload), ipc "
        "(CUDA IPC, trainer and engine on one GPU), nccl (NCCL, the engine on other GPUs).",
    )

    @model_validator(mode="after")
    def _one_memory_setting(self) -> VllmSettings:
        if (self.kv_cache_gb is None) == (self.memory_fraction is None):
            raise ValueError("set exactly one of kv_cache_gb and memory_fraction")
        return self


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _settings(raw: VllmSettings | dict[str, Any], key: str) -> VllmSettings:
    if isinstance(raw, VllmSettings):
        return raw
    try:
        return VllmSettings.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        where = f"{key}.{loc}" if loc else key
        raise ConfigError(f"config key '{where}': {first['msg']}") from None


def model_positions(model_dir: Path) -> int | None:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    value = config.get("max_position_embeddings")
    return int(value) if value is not None else None


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _available_gib() -> float:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def check_settings(
    raw: VllmSettings | dict[str, Any], model_dir: str | os.PathLike[str], *, key: str = "vllm"
) -> VllmSettings:
    """The settings, checked against the model and this machine, or a one-line `ConfigError`
    that names the bad key (`key`: where the settings sit in the config)."""
    settings = _settings(raw, key)
    directory = Path(model_dir)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"vLLM needs a model directory with config.json, got {str(directory)!r}")
    positions = model_positions(directory)
    if settings.max_model_len is not None and positions and settings.max_model_len > positions:
        raise ConfigError(
            f"config key '{key}.max_model_len': {settings.max_model_len} exceeds the model's "
            f"{positions} positions"
        )
    gpus = torch.cuda.device_count()
    if gpus == 0 and settings.dtype == "float16":
        raise ConfigError(f"config key '{key}.dtype': float16 needs a GPU; use float32 or bfloat16")
    if settings.tensor_parallel_size > max(gpus, 1):
        raise ConfigError(
            f"config key '{key}.tensor_parallel_size': {settings.tensor_parallel_size} exceeds "
            f"the {max(gpus, 1)} device(s) here"
        )
    if gpus == 0 and settings.kv_cache_gb is not None and settings.kv_cache_gb > _available_gib():
        raise ConfigError(
            f"config key '{key}.kv_cache_gb': {settings.kv_cache_gb:g} GiB is more than the "
            f"{_available_gib():.1f} GiB of memory available"
        )
    cores = _cores()
    if (
        gpus == 0
        and settings.cpu_reserved_cores is not None
        and settings.cpu_reserved_cores >= cores
    ):
        raise ConfigError(
            f"config key '{key}.cpu_reserved_cores': {settings.cpu_reserved_cores} leaves none "
            f"of the {cores} cores here to the engine"
        )
    _check_transfer(settings, gpus, key)
    return settings


def _check_transfer(settings: VllmSettings, gpus: int, key: str) -> None:
    """`weight_transfer` against the GPUs here: ipc shares the trainer's one GPU with a one-device
    engine; nccl needs the trainer's GPU plus `tensor_parallel_size` others for the engine."""
    mode, where = settings.weight_transfer, f"config key '{key}.weight_transfer'"
    if mode == "shared_memory":
        return
    if gpus == 0:
        raise ConfigError(f"{where}: {mode} needs CUDA; on CPU use shared_memory (the default)")
    if mode == "ipc" and settings.tensor_parallel_size != 1:
        raise ConfigError(
            f"{where}: ipc shares the trainer's one GPU, so tensor_parallel_size must be 1 "
            f"(got {settings.tensor_parallel_size}); use nccl to span GPUs"
        )
    if mode == "nccl" and gpus < settings.tensor_parallel_size + 1:
        raise ConfigError(
            f"{where}: nccl needs {settings.tensor_parallel_size + 1} GPUs (the trainer's and "
            f"{settings.tensor_parallel_size} for the engine), {gpus} here; with one GPU use ipc"
        )


def engine_devices(settings: VllmSettings) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for the engine's processes: the trainer's GPU (ipc), or the first
    `tensor_parallel_size` GPUs after it (nccl); None: vLLM's own choice."""
    if settings.weight_transfer == "shared_memory" or torch.cuda.device_count() == 0:
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]
    trainer = torch.cuda.current_device()
    if settings.weight_transfer == "ipc":
        return visible[trainer]
    others = [device for i, device in enumerate(visible) if i != trainer]
    return ",".join(others[: settings.tensor_parallel_size])


def reserved_cores(settings: VllmSettings) -> int | None:
    """Cores vLLM's CPU engine leaves free (None: vLLM's own choice)."""
    if settings.cpu_reserved_cores is not None:
        return settings.cpu_reserved_cores
    if _RESERVED_ENV in os.environ:
        return None  # the user's own setting of vLLM's variable
    return 0 if _cores() <= SMALL_MACHINE_CORES else None


def engine_environment(settings: VllmSettings) -> dict[str, str]:
    """Environment variables the engine's processes must start with (vLLM reads these settings
    only from its environment)."""
    environment: dict[str, str] = {}
    if torch.cuda.device_count() == 0:
        reserved = reserved_cores(settings)
        if reserved is not None:
            environment[_RESERVED_ENV] = str(reserved)
        # A reload re-materialises every layer and repacks it into fresh memory: huge pages
        # fault it in 512x fewer times (the first 0.36B fp32 sync 1.8 s, not 2.9 s).
        if _HUGE_PAGES_ENV not in os.environ:
            environment[_HUGE_PAGES_ENV] = "1"
    devices = engine_devices(settings)
    return environment if devices is None else environment | {"CUDA_VISIBLE_DEVICES": devices}


def engine_arguments(settings: VllmSettings, directory: Path) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` for `settings` on the model directory `directory` (checked)."""
    max_len = settings.max_model_len or model_positions(directory)
    # On CPU, vLLM 0.31 rewinds a seeded request's generator after a chunked prefill step,
    # and CPU generators cannot rewind: the engine dies ("CPU Generator does not use
    # offset") once a step's prompts pass its token budget. Unchunked, each prompt is
    # prefilled whole (the budget holds the longest sequence).
    unchunked: dict[str, Any] = (
        {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_len or 0, 2048)}
        if torch.cuda.device_count() == 0
        else {}
    )
    return dict(
        model=str(directory),
        dtype=settings.dtype,
        max_model_len=max_len,
        enforce_eager=settings.enforce_eager,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
        kv_cache_memory_bytes=(
            int(settings.kv_cache_gb * 2**30) if settings.kv_cache_gb is not None else None
        ),
        gpu_memory_utilization=settings.memory_fraction or 0.9,
        logprobs_mode="processed_logprobs",
        max_logprobs=MAX_PROMPT_TOP_K,
        disable_log_stats=True,
        # The engine side of vLLM's weight transfer (torchkit/vllm_transfer.py).
        weight_transfer_config=(
            None
            if settings.weight_transfer == "shared_memory"
            else {"backend": settings.weight_transfer}
        ),
        **unchunked,
    )
