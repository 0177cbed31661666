"""vLLM's engine processes: the CPU cores they get, that they end with the process that started
them, however it ends, and what they print (the real vLLM on a built-in tiny model; skipped
without vLLM)."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import psutil
import torch

from torchkit import vllm_settings
from torchkit.vllm_logging import QuietFilter, quiet
from torchkit.vllm_settings import VllmSettings, engine_environment

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
ROOT = Path(__file__).resolve().parents[1]

# Starts an engine, says where its weights file lives, and waits to be killed.
SCRIPT = """
import sys, time
from torchkit.vllm_engine import VllmSampler

if __name__ == "__main__":
    sampler = VllmSampler.start(sys.argv[1], {"kv_cache_gb": 0.25})
    print("weights:", sampler._weights_dir, flush=True)
    time.sleep(600)
"""

# The simplest script: a sampler in `__main__`'s globals that samples and syncs, and is shut down
# after its event loop ended. Its own log lines carry "trainer:", as a trainer's console would.
SAMPLE_AND_EXIT = """
import asyncio, logging, sys
from torchkit.vllm_engine import VllmSampler
from unified.types import SamplingParams

async def main(sampler):
    await sampler.warm_up()
    await sampler.load_weights(sampler.weights(), version=1)
    return await sampler.sample([1, 2, 3], SamplingParams(max_tokens=4))

if __name__ == "__main__":
    logging.basicConfig(format="trainer: %(name)s: %(message)s")
    sampler = VllmSampler.start(sys.argv[1], {"kv_cache_gb": 0.25})
    output = asyncio.run(main(sampler))
    sampler.shutdown()
    print("sampled", len(output.completion_ids), "on version", output.policy_version, flush=True)
"""


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="CPU cores: the CPU engine's setting")
def test_on_a_small_machine_the_engine_runs_on_every_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RESERVED, raising=False)
    monkeypatch.setattr(vllm_settings, "_cores", lambda: 2)
    assert engine_environment(VllmSettings())[RESERVED] == "0"
    assert engine_environment(VllmSettings(cpu_reserved_cores=1))[RESERVED] == "1"
    monkeypatch.setattr(vllm_settings, "_cores", lambda: 32)
    assert RESERVED not in engine_environment(VllmSettings()), "a large machine: vLLM's own"
    monkeypatch.setattr(vllm_settings, "_cores", lambda: 2)
    monkeypatch.setenv(RESERVED, "1")
    assert RESERVED not in engine_environment(VllmSettings()), "the user's own variable is kept"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the CPU engine's memory")
def test_the_cpu_engine_allocates_on_huge_pages_unless_the_user_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(HUGE_PAGES, raising=False)
    assert engine_environment(VllmSettings())[HUGE_PAGES] == "1"
    monkeypatch.setenv(HUGE_PAGES, "0")
    assert HUGE_PAGES not in engine_environment(VllmSettings()), "the user's own variable is kept"


def started(process: subprocess.Popen[str], deadline_s: float) -> str:
    """The line `process` prints once its engine runs (vLLM's log lines before it skipped)."""
    assert process.stdout is not None
    end = time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([process.stdout], [], [], left)
        line = process.stdout.readline() if ready else ""
        if line.startswith("weights: "):
            return line.strip()
        if ready and not line:
            raise AssertionError(f"the trainer exited (rc {process.wait()}) before its engine ran")
    raise AssertionError(f"the engine did not start within {deadline_s:g} s")


def test_a_killed_trainer_leaves_no_engine_process_and_no_weights_file(
    tmp_path: Path, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(SCRIPT)
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(policy[2])],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        weights_dir = Path(started(trainer, deadline_s=240).removeprefix("weights: "))
        assert weights_dir.is_dir(), weights_dir
        engine = psutil.Process(trainer.pid).children(recursive=True)
        assert engine, "vLLM runs its engine in child processes"
    finally:
        trainer.kill()  # SIGKILL: no shutdown, no atexit
        trainer.wait(timeout=30)
    _, alive = psutil.wait_procs(engine, timeout=60)
    assert not alive, f"engine processes outlived the trainer: {alive}"
    deadline = time.monotonic() + 10
    while weights_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not weights_dir.exists(), "the weights file in shared memory outlived the trainer"


@pytest.fixture(scope="module")
def sampled_and_exited(
    tmp_path_factory: pytest.TempPathFactory, policy: tuple[torch.nn.Module, object, Path]
) -> subprocess.CompletedProcess[str]:
    """`SAMPLE_AND_EXIT` run to its end at vLLM's default console settings: one engine for the
    tests of its exit and of what it printed."""
    script = tmp_path_factory.mktemp("sample") / "sample.py"
    script.write_text(SAMPLE_AND_EXIT)
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "PYTHONWARNINGS"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, str(script), str(policy[2])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_script_that_syncs_and_shuts_its_sampler_down_after_its_loop_exits(
    sampled_and_exited: subprocess.CompletedProcess[str],
) -> None:
    # vLLM closes its client's sockets on the loop they were made on; once `asyncio.run` has
    # closed that loop it left them open, and the interpreter's exit hung on them (zmq's
    # context term) after the script had printed everything.
    run = sampled_and_exited
    assert run.returncode == 0, run.stderr[-2000:]
    assert "sampled 4 on version 1" in run.stdout.splitlines()


# What a run on vLLM printed before: warnings that hold on every run and ask nothing of the user
# (torchkit/vllm_logging.py says why each is noise), a deprecation our request caused, a
# progress bar, and an engine killed at shutdown that leaked its shared-memory queues.
NOISE = [
    "does not officially support disabling chunked prefill",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "Model Runner V2 requires Triton",
    "triton-cpu is expected",
    "Reset SSM cache type",
    "DeepSelect extension",
    "VLLM_CPU_NUM_OF_RESERVED_CPU is less than",
    "OMP_NUM_THREADS=",
    "Failed to load weights",  # vLLM's reload, a line per sync (rotary embeddings)
    "reduce_op",
    "Loading safetensors checkpoint shards",
    "Passing raw prompts",
    "force killing",
    "leaked shared_memory",
]


def test_a_run_on_vllm_prints_none_of_its_noise_and_shuts_the_engine_down_in_order(
    sampled_and_exited: subprocess.CompletedProcess[str],
) -> None:
    run = sampled_and_exited
    assert run.returncode == 0, run.stderr[-2000:]
    lines = (run.stdout + run.stderr).splitlines()  # vLLM logs to stdout
    printed = [line for line in lines if any(noise in line for noise in NOISE)]
    assert not printed, "vLLM's noise on the console:\n" + "\n".join(printed)
    # The engine's processes say this as they import vLLM, before any logging configuration
    # applies (docs/engines.md); the trainer's own console must not.
    trainer_triton = [line for line in lines if line.startswith("trainer:") and "Triton" in line]
    assert not trainer_triton, trainer_triton


def record(logger: str, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.WARNING, "vllm.py", 1, message, args, None)


def test_the_quiet_filter_drops_the_listed_warnings_and_nothing_else() -> None:
    keeps = QuietFilter().filter
    assert not keeps(record("vllm.config.vllm", "Enforce eager set, disabling torch.compile"))
    assert keeps(record("vllm.engine.arg_utils", "Enforce eager set")), "another logger's line"
    preload = "%s is not found in LD_PRELOAD. For best performance, please follow the section"
    assert keeps(record("vllm.v1.worker.cpu_worker", preload, "libtcmalloc")), "advice stays"
    reload_logger = "vllm.model_executor.model_loader.reload.layerwise"
    assert not keeps(record(reload_logger, "%s: Failed to load weights", "RotaryEmbedding"))
    assert keeps(record(reload_logger, "%s: Failed to load weights", "QKVParallelLinear")), (
        "a layer with weights that failed to load is a real error"
    )


def test_vllm_logging_level_info_or_a_logging_config_of_ones_own_shows_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    assert quiet(), "the trainer's default level drops the noise"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    assert not quiet(), "VLLM_LOGGING_LEVEL=INFO shows every line"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/tmp/mine.json")
    assert not quiet(), "the user's own logging configuration is applied as it is"
