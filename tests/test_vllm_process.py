"""vLLM's engine processes: the CPU cores they get, and that they end with the process that
started them, however it ends (the real vLLM on a built-in tiny model; skipped without vLLM)."""

from __future__ import annotations

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
# after its event loop ended.
SAMPLE_AND_EXIT = """
import asyncio, sys
from torchkit.vllm_engine import VllmSampler
from unified.types import SamplingParams

async def main(sampler):
    await sampler.warm_up()
    await sampler.load_weights(sampler.weights(), version=1)
    return await sampler.sample([1, 2, 3], SamplingParams(max_tokens=4))

if __name__ == "__main__":
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


def test_a_script_that_syncs_and_shuts_its_sampler_down_after_its_loop_exits_quietly(
    tmp_path: Path, policy: tuple[torch.nn.Module, object, Path]
) -> None:
    # vLLM closes its client's sockets on the loop they were made on; once `asyncio.run` has
    # closed that loop it left them open, and the interpreter's exit hung on them (zmq's
    # context term) after the script had printed everything.
    script = tmp_path / "sample.py"
    script.write_text(SAMPLE_AND_EXIT)
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(script), str(policy[2])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "sampled 4 on version 1" in run.stdout.splitlines()
    # vLLM's reload warned about every rotary embedding (it loads no weights): a line per sync.
    assert "Failed to load weights" not in run.stdout + run.stderr  # vLLM logs to stdout
