"""Headless Chromium over the DevTools protocol, for tests that open a page as a person would.

Starts Debian's `chromium` (`--headless=new`, a fresh profile, DevTools on a free port of
127.0.0.1), drives one tab over its WebSocket and keeps every console error and uncaught
exception the page raised. The report needs no browser to be written; its test and
`bench.report` open it in one.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

__all__ = ["Chromium", "chromium_path"]


def chromium_path() -> str | None:
    """The Chromium executable on PATH (Debian's `chromium`), if any."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """One headless browser with one tab; use as a context manager."""

    def __init__(self, executable: str, profile: Path, *, width: int = 1280, height: int = 900):
        self._process = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its renderer and helper processes go with it
        )
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        try:
            port = self._devtools_port(deadline=time.monotonic() + 60)
            self._socket = connect(self._page_socket(port), max_size=None, open_timeout=30)
            for domain in ("Page", "Runtime", "Log"):
                self.send(f"{domain}.enable")
            self.send(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        socket = getattr(self, "_socket", None)
        if socket is not None:
            socket.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        if self._process.stderr is not None:
            self._process.stderr.close()

    def _devtools_port(self, *, deadline: float) -> int:
        assert self._process.stderr is not None
        while time.monotonic() < deadline:
            line = self._process.stderr.readline()
            if not line and self._process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._process.returncode}")
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                return int(found.group(1))
        raise TimeoutError("chromium did not open its DevTools port within 60 s")

    @staticmethod
    def _page_socket(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as reply:
            targets = json.load(reply)
        pages = [t for t in targets if t.get("type") == "page"]
        if not pages:
            raise RuntimeError("chromium has no page to drive")
        url: str = pages[0]["webSocketDebuggerUrl"]
        return url

    def send(self, method: str, timeout_s: float = 60, **params: Any) -> dict[str, Any]:
        """Call one DevTools method; its result. Events that arrive meanwhile are kept."""
        socket: ClientConnection = self._socket
        call = next(self._ids)
        socket.send(json.dumps({"id": call, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(socket.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == call:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            self.events.append(message)

    def open(self, url: str, *, ready: str, timeout_s: float = 60) -> None:
        """Load `url`, then wait until the page says `ready` (a JavaScript expression) is true."""
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        # While the page loads, its document may have no body yet: that is "not ready".
        while not self.evaluate(
            f"(() => {{ try {{ return !!({ready}); }} catch {{ return false; }} }})()"
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: {ready} not true within {timeout_s:g} s")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        reply = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions the page raised so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append(details.get("exception", {}).get("description") or details["text"])
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(" ".join(str(a.get("value", a)) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def screenshot(self, path: Path) -> Path:
        """The whole page as a PNG at `path`."""
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path
