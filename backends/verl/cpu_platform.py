"""verl's CPU platform: lets verl's real training worker (FSDP2) run on CPU processes over gloo.

verl picks its accelerator through its own platform hooks (`verl.plugin.platform`): a registered
`PlatformBase` chosen by `VERL_PLATFORM`, modules named in `VERL_USE_EXTERNAL_MODULES` imported
from `verl/__init__`. This module registers the platform `"cpu"` there: device `"cpu"`,
collectives on gloo, the Ray resource `"CPU"`, and a device module whose memory and seed calls
do nothing. `cpu_environment()` is what a process (the driver or a Ray worker) needs to pick it.
Unsupported by verl itself: pinned to verl 0.9.1 and used only when no GPU is asked for.

This module is imported inside `import verl`, so it must import nothing of verl but the plugin
base classes, and nothing of `backends.verl` at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

__all__ = ["PLATFORM_NAME", "CPUPlatform", "cpu_environment"]

PLATFORM_NAME = "cpu"


def cpu_environment() -> dict[str, str]:
    """Environment variables that make a process's `import verl` choose this platform."""
    return {
        "VERL_PLATFORM": PLATFORM_NAME,
        "VERL_USE_EXTERNAL_MODULES": __name__,
        # verl registers its FSDP engines for the devices "cuda" and "npu" only.
        "VERL_ENGINE_DEVICE": "cuda",
        "CUDA_VISIBLE_DEVICES": "",
    }


class _NoDevice:
    """Stands in for `torch.cuda`: memory figures are 0, seeds and syncs do nothing."""

    @staticmethod
    def get_device_name(*args: Any, **kwargs: Any) -> str:
        return "CPU"  # verl's FLOPs counter looks the device up by this name

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
        return (0, 0)

    @staticmethod
    def memory_stats(*args: Any, **kwargs: Any) -> dict[str, int]:
        return {}

    @staticmethod
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    def __getattr__(self, name: str) -> Any:
        # max_memory_allocated, empty_cache, synchronize, manual_seed, reset_peak_memory_stats...
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: 0


@PlatformRegistry.register(platform=PLATFORM_NAME)
class CPUPlatform(PlatformBase):  # type: ignore[misc]
    """verl's platform interface answered for plain CPU processes."""

    _module = _NoDevice()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only VERL_PLATFORM=cpu selects it.
        return os.environ.get("VERL_PLATFORM", "") == PLATFORM_NAME

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"  # a string, so `module.to(get_device_id())` works

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        return None

    def manual_seed_all(self, seed: int) -> None:
        return None

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
