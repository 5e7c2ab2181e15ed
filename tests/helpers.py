"""Small helpers shared by the tests: waiting for a condition, reading the sample buffer, JSON
over HTTP, a free port, a JSON-answering request handler for stand-in servers served in a
thread, and the toy model with a chat template."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from proto import SampleGroup
from services.sample_buffer import SampleBuffer


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """`check()`'s first truthy value; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def read_all(buffer: SampleBuffer) -> list[SampleGroup]:
    """Every group the tests' own consumer (`test`) has not read yet: a second call returns
    only groups put since the first."""
    out = []
    while batch := buffer.read_groups("test", 1000, block_ms=None):
        out += [g for _id, g in batch]
    return out


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: dict) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def free_port() -> int:
    """A port nothing listens on right now (for a URL that must refuse connections)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class JsonHandler(BaseHTTPRequestHandler):
    """Base of the tests' stand-in HTTP servers: JSON answers, no request log."""

    def send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free loopback port by a thread (a thread a request) until the
    block ends; its URL. (Its socket stays bound after: a request then waits, unanswered.)"""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def with_chat_template(model_dir: Path, out: Path, template: str) -> Path:
    """A copy of the HF directory `model_dir` at `out` whose tokenizer has `template`."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
    return out


def router_args(
    buffer: SampleBuffer,
    model: Path,
    urls: list[str],
    *extra: str,
    batch: int = 4,
    n: int = 2,
    response_len: int = 4,
    max_buffer_depth: int = 1000,
) -> list[str]:
    """`tandem router` flags of a test: any free port, the test's buffer and run id, small
    batches; `extra` flags come last (argparse keeps the last value of a flag given twice)."""
    return [
        "router",
        "--port",
        "0",
        "--engine-urls",
        *urls,
        "--model",
        str(model),
        "--redis-url",
        buffer.config.redis_url,
        "--run-id",
        buffer.config.run_id,
        "--rollout-batch-size",
        str(batch),
        "--n-samples-per-prompt",
        str(n),
        "--rollout-max-response-len",
        str(response_len),
        "--max-buffer-depth",
        str(max_buffer_depth),
        *extra,
    ]


def run_bench(script: str, *args: str, timeout_s: float = 120) -> list[str]:
    """The stdout lines of `python bench/SCRIPT ARGS`, which must exit 0."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()
