"""The local Tinker server in a child process, as the tinker backend starts it for offline runs.

`unified tinker-serve --port 0 --exit-with-stdin` runs in a child Python process, so
its work (HTTP handling, sampling, training) has its own interpreter and never waits on the
trainer's GIL, and the trainer's SDK thread never waits on it. The child prints its URL once it
has loaded the model; it stops when its stdin closes, so a trainer that dies takes it along.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

from torchkit.vllm_settings import VllmSettings
from unified.errors import UsageError

__all__ = ["ServerProcess"]

# The child imports this very checkout of `tinker_server` (not one its working directory shadows).
_ROOT = Path(__file__).resolve().parents[2]
_MAIN = (
    f"import sys; sys.path.insert(0, {str(_ROOT)!r}); "
    "from tinker_server.server import main; sys.exit(main(sys.argv[1:]))"
)
_URL = re.compile(rb" at (http://\S+) ")


class ServerProcess:
    """A `unified tinker-serve` child: `await start()` gives its URL, `await stop()` ends it."""

    def __init__(
        self,
        model: str,
        *,
        store: Path,
        max_batch: int = 64,
        engine: str = "builtin",
        vllm: VllmSettings | None = None,
    ) -> None:
        self.args = [
            "-c",
            _MAIN,
            "--port",
            "0",
            "--model",
            model,
            "--store",
            str(store),
            "--max-batch",
            str(max_batch),
            "--exit-with-stdin",
            "--engine",
            engine,
        ]
        if engine == "vllm" and vllm is not None:
            self.args += ["--vllm", vllm.model_dump_json()]
        self._process: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float) -> str:
        """Start the child and wait (at most `timeout_s`) for its URL."""
        self._process = process = await asyncio.create_subprocess_exec(
            sys.executable,
            *self.args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # Its own session: a Ctrl-C at the terminal reaches the trainer, which stops in order
            # and needs the server for its last step and checkpoint; the server ends with stdin.
            start_new_session=True,
        )
        assert process.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                line = await process.stdout.readline()
        except TimeoutError:
            await self.stop()
            raise UsageError(
                f"the local Tinker server did not start within {timeout_s:g} s "
                "(tinker.request_timeout_s)"
            ) from None
        found = _URL.search(line)
        if found is None:
            await self.stop()
            raise UsageError("the local Tinker server failed to start (its error is printed above)")
        return found.group(1).decode()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Close the child's stdin (it stops serving) and wait for it; kill it and whatever it
        started if it hangs."""
        process, self._process = self._process, None
        if process is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                # End of input is the child's signal to stop (`communicate()` without input
                # leaves stdin open on Python 3.11); then read stdout to its end and wait.
                if process.stdin is not None:
                    process.stdin.close()
                await process.communicate()
        except TimeoutError:
            # Its whole process group (its own session): a vLLM engine process the child left
            # behind would hold stdout open, and reading it to its end would never return.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
