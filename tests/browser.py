"""A headless Chromium driven over the DevTools protocol (one websocket, no browser download):
enough to open a page, read it with JavaScript and take a screenshot.

Uses the system `chromium` (Debian: `apt-get install chromium`) and the `websockets` package.
The browser runs in its own process group with a throw-away profile and is killed by group.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

from tandem.supervisor import die_with_parent


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """`chromium --headless` with one page: `Browser(...)` starts it, `connect()` waits for it;
    `evaluate` runs JavaScript in the page."""

    def __init__(self, binary: str, workdir: Path, width: int = 1400, height: int = 1000):
        profile = workdir / "chromium-profile"
        self.log = open(workdir / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # tests may run as root, where the sandbox refuses to start
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.profile, self.workdir = profile, workdir
        self.ws = None

    def connect(self) -> Browser:
        """Wait for the DevTools endpoint (the browser starts meanwhile) and open the page's."""
        port_file = self.profile / "DevToolsActivePort"
        workdir = self.workdir
        deadline = time.monotonic() + 20
        while not port_file.exists() or len(port_file.read_text().split()) < 2:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start; see {workdir / 'chromium.log'}")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            page = next(t for t in json.loads(resp.read()) if t["type"] == "page")
        self.stack = contextlib.ExitStack()
        self.ws = self.stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20)
        )
        self.next_id = 0
        return self

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events arriving meanwhile are skipped)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=30))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of `expression` (awaited when it is a promise)."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        if self.ws is not None:
            self.stack.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
