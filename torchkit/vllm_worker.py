"""What runs inside vLLM's engine processes: the worker extension and a guard against orphans.

vLLM runs the model in child processes (the engine core, and its workers). A trainer that ends
without shutting the engine down (SIGKILL, or a signal it does not handle) leaves them running,
re-parented, holding the model, the KV cache and the shared weights file in `/dev/shm`. vLLM's
workers follow the engine core down, but nothing ends the engine core. So `VllmSampler.start`
names itself and its scratch directory in the environment its engine processes inherit
(`GUARD_ENV`); when vLLM imports this module in them (to resolve `worker_extension_cls`), a
guard thread starts that, once the trainer is gone, removes the scratch directory and stops the
engine core (SIGTERM: vLLM's own shutdown, which ends its workers).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

from torchkit.vllm_weights import WeightsReceiver

__all__ = ["GUARD_ENV", "WorkerExtension", "guard_environment"]

GUARD_ENV = "UNIFIED_VLLM_GUARD"
"""`<trainer pid>:<scratch directories, os.pathsep between>`, set while an engine starts."""

_POLL_S = 1.0
_GRACE_S = 15.0  # after SIGTERM, how long the engine core gets before SIGKILL


class WorkerExtension(WeightsReceiver):
    """The class vLLM mixes into its worker (`worker_extension_cls`): the weights' receiving
    side (`load_shared_weights`)."""


def guard_environment(scratch: list[str]) -> dict[str, str]:
    """The environment entry that makes engine processes started now stop, and remove the
    directories `scratch`, if this process ends without them."""
    return {GUARD_ENV: f"{os.getpid()}:{os.pathsep.join(scratch)}"}


def _parent(pid: int) -> int | None:
    """`pid`'s parent, or None once `pid` is gone (reads /proc: no dependency)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _engine_root(trainer: int) -> int | None:
    """This process's ancestor (or itself) whose parent is `trainer`: the engine core."""
    pid: int | None = os.getpid()
    for _ in range(8):
        if pid is None or pid <= 1:
            return None
        parent = _parent(pid)
        if parent == trainer:
            return pid
        pid = parent
    return None


def _guard(trainer: int, root: int, scratch: list[str]) -> None:
    while _parent(root) == trainer:
        time.sleep(_POLL_S)
    if _parent(root) is None:  # the engine core ended first: vLLM shuts its workers down
        return
    for directory in scratch:
        shutil.rmtree(directory, ignore_errors=True)
    try:
        os.kill(root, signal.SIGTERM)
        time.sleep(_GRACE_S)
        os.kill(root, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start_guard() -> None:
    value = os.environ.get(GUARD_ENV)
    if not value:
        return
    pid_text, _, paths = value.partition(":")
    scratch = [path for path in paths.split(os.pathsep) if path]
    trainer = int(pid_text)
    if trainer == os.getpid():
        return  # the trainer itself imported this module
    root = _engine_root(trainer)
    if root is None:
        return
    threading.Thread(
        target=_guard, args=(trainer, root, scratch), name="unified-orphan-guard", daemon=True
    ).start()


_start_guard()
