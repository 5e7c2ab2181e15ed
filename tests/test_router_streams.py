"""Streamed `/generate` through the router process when a worker fails: retried on another
worker until the first event, and ended with an `error` event and `[DONE]` after it.

The failing worker is a small real HTTP server in the test that answers like an SGLang worker
(`/get_model_info`, an SSE `/generate`) and breaks its connection at a chosen point."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import ClassVar

import httpx
import pytest

from tests.helpers import JsonHandler, serving

GEN = {"input_ids": [1, 4, 5, 14], "sampling_params": {"max_new_tokens": 4}, "stream": True}
FIRST_EVENT = {"text": "5", "output_ids": [9], "meta_info": {"id": "r1", "finish_reason": None}}


class DyingWorker(JsonHandler):
    """An SGLang worker whose `/generate` breaks as `mode` says:
    `refuse` closes before any answer, `http_500` answers 500, `empty_stream` sends the SSE
    headers and closes; `die_chunked` / `die_close` send one event and half of a second, then
    close (a chunked body, or one delimited by the connection's end)."""

    mode = "refuse"
    generate_calls: ClassVar[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server names it
        info = {
            "model_path": "dying",
            "tokenizer_path": "dying",
            "is_generation": True,
            "weight_version": "0",
        }
        self.send_json(200, info)

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.generate_calls.append(self.mode)
        if self.mode == "refuse":
            return self.die()
        if self.mode == "http_500":
            return self.send_json(500, {"error": "worker is broken"})
        chunked = self.mode == "die_chunked"
        if chunked:
            self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.mode != "empty_stream":
            self.write(b"data: " + json.dumps(FIRST_EVENT).encode() + b"\n\n", chunked)
            self.write(b'data: {"text": "5', chunked)
        self.die()

    def write(self, data: bytes, chunked: bool) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        self.wfile.flush()

    def die(self) -> None:
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True


@pytest.fixture
def dying_worker() -> Iterator[Callable[[str], tuple[str, list[str]]]]:
    """`dying_worker(mode)` -> (URL, the list of its /generate calls)."""
    with ExitStack() as servers:

        def _start(mode: str) -> tuple[str, list[str]]:
            calls: list[str] = []
            handler = type("Worker", (DyingWorker,), {"mode": mode, "generate_calls": calls})
            return servers.enter_context(serving(handler)), calls

        yield _start


def start_router(start_service, buffer, urls: list[str]):
    return start_service(
        "router",
        [
            "router",
            "--port",
            "0",
            "--no-rollout",
            "--redis-url",
            buffer.config.redis_url,
            "--run-id",
            buffer.config.run_id,
            "--policy",
            "round_robin",
            "--engine-urls",
            *urls,
        ],
    )


def events(router_url: str) -> list[str]:
    """The `data:` lines of one streamed /generate; a hang fails on the client's timeout."""
    with httpx.stream("POST", router_url + "/generate", json=GEN, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("refuse", "ServerDisconnectedError"),
        ("http_500", "HTTP 500"),
        ("empty_stream", "the stream ended before its first event"),
    ],
)
def test_a_stream_whose_worker_fails_before_its_first_event_is_retried_on_another(
    buffer, start_service, engines, dying_worker, mode, reason
):
    bad_url, calls = dying_worker(mode)
    good = engines()
    router = start_router(start_service, buffer, [bad_url, good.url])
    for _ in range(4):
        got = events(router.url)
        assert got[-1] == "data: [DONE]" and len(got) == 2
        assert json.loads(got[0].removeprefix("data: "))["output_ids"] == [5, 4, 2]
    assert calls, "round robin starts with the first worker, the dying one"
    bad = next(
        w for w in httpx.get(router.url + "/workers").json()["workers"] if w["url"] == bad_url
    )
    assert bad["errors"] == len(calls) and bad["outstanding"] == 0
    assert reason in bad["last_error"]


@pytest.mark.parametrize("mode", ["die_chunked", "die_close"])
def test_a_stream_whose_worker_dies_mid_stream_ends_with_an_error_event_and_done(
    buffer, start_service, dying_worker, mode
):
    bad_url, calls = dying_worker(mode)
    router = start_router(start_service, buffer, [bad_url])
    got = events(router.url)
    assert len(got) == 3, got
    assert json.loads(got[0].removeprefix("data: ")) == FIRST_EVENT, "the whole event, once"
    error = json.loads(got[1].removeprefix("data: "))["error"]
    assert error["type"] == "worker_failed" and error["code"] == 502
    assert bad_url in error["message"]
    assert got[2] == "data: [DONE]", "half of the second event was never sent"
    assert calls == [mode], "not retried once an event was sent"
    (worker,) = httpx.get(router.url + "/workers").json()["workers"]
    assert worker["outstanding"] == 0 and worker["errors"] == 1
