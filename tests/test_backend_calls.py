"""Blocking backend calls off the event loop: a call stuck past its deadline holds nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

from unified.backend_calls import BackendCalls, run_status
from unified.config import TrainerSection
from unified.errors import TrainingInterrupted
from unified.testing import BanditBackend
from unified.threads import DaemonWorker

STUCK_CALL = """
import asyncio, threading
from unified.threads import {runner}

async def main():
    stuck = threading.Event()
    {setup}
    try:
        async with asyncio.timeout(0.2):
            await {call}
    except TimeoutError:
        print("abandoned", flush=True)

asyncio.run(main())
"""


async def test_a_daemon_worker_runs_calls_in_turn_on_one_thread() -> None:
    worker = DaemonWorker("test-calls")
    names = await asyncio.gather(*[worker.run(lambda: threading.current_thread().name)] * 4)
    assert names == ["test-calls"] * 4
    with pytest.raises(ZeroDivisionError):
        await worker.run(lambda: 1 / 0)
    assert await worker.run(lambda: "still serving") == "still serving"


@pytest.mark.parametrize(
    ("runner", "setup", "call"),
    [
        ("DaemonWorker", "worker = DaemonWorker('calls')", "worker.run(stuck.wait)"),
        ("in_daemon_thread", "pass", "in_daemon_thread(stuck.wait)"),
    ],
)
def test_a_call_stuck_past_its_deadline_does_not_hold_the_process_exit(
    runner: str, setup: str, call: str
) -> None:
    script = textwrap.dedent(STUCK_CALL).format(runner=runner, setup=setup, call=call)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "abandoned", done.stderr


def test_the_status_a_command_reports_names_the_first_real_cause() -> None:
    assert run_status(None) == ("success", None)
    nested = ExceptionGroup("tasks", [ExceptionGroup("inner", [ValueError("bad\nmore")])])
    assert run_status(nested) == ("errored", "ValueError: bad"), "one line, not the wrapper"
    stopped = TrainingInterrupted("stopped after step 3", signal_number=2)
    assert run_status(stopped)[0] == "interrupted"
    assert run_status(BaseExceptionGroup("tasks", [asyncio.CancelledError()]))[0] == "interrupted"


class OutcomeFails(BanditBackend):
    shut_down = False

    def set_outcome(self, status: str, detail: str | None = None) -> None:
        raise RuntimeError("the hook is broken")

    async def shutdown(self) -> None:
        self.shut_down = True


async def test_a_failing_outcome_hook_neither_fails_the_command_nor_skips_the_shutdown() -> None:
    backend = OutcomeFails()
    await BackendCalls(backend, TrainerSection()).shutdown(None)
    assert backend.shut_down
