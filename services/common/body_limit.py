"""A request-size cap for every Tandem HTTP service (`--max-request-bytes`).

Pure ASGI, outermost (wrapped by `serving.serve`, so it also guards layers such as the router's
fast path that read bodies themselves): a request whose `Content-Length` exceeds the cap is
answered 413 before any of its body is read; a body without a length (chunked) is counted as it
arrives (held here, never more than the cap) and, once past the cap, read to its end and
dropped before the 413: a server that closes a connection with unread data resets it, and the
client would not read the answer (half the tries did not). That drain is bounded by `DRAIN_BYTES`
and `DRAIN_S`; past either the 413 goes out anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from starlette.responses import JSONResponse

Scope = dict[str, Any]
Receive = Any
Send = Any
DRAIN_BYTES = 64 << 20  # of a chunked body past the cap, read and dropped before the 413
DRAIN_S = 5.0


def _too_large(limit: int, flag: str) -> JSONResponse:
    message = f"request body over {limit} bytes; raise the service's {flag} to accept it"
    body = {"error": {"message": message, "code": 413}, "detail": message}
    return JSONResponse(body, 413, headers={"connection": "close"})


async def _drain(receive: Receive, more: bool) -> None:
    """Read the rest of a body (see the module docstring for why and how far)."""
    drained, deadline = 0, time.monotonic() + DRAIN_S
    with contextlib.suppress(TimeoutError):
        while more and drained <= DRAIN_BYTES:
            message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            drained += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)


class BodyLimitMiddleware:
    """413 for a request body over `limit` bytes (0 = no cap)."""

    def __init__(self, app: Any, limit: int, flag: str = "--max-request-bytes") -> None:
        self.app, self.limit, self.flag = app, limit, flag

    def __getattr__(self, name: str) -> Any:  # e.g. `.state` of the wrapped FastAPI app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.limit <= 0:
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _too_large(self.limit, self.flag)(scope, receive, send)
            return
        if length is not None:
            await self.app(scope, receive, send)
            return
        # No length (chunked): read it here, at most `limit` bytes, then hand it on.
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = message.get("more_body", False)
            if seen > self.limit:
                await _drain(receive, more)
                await _too_large(self.limit, self.flag)(scope, receive, send)
                return
        await self.app(scope, replaying(b"".join(chunks), receive), send)


def replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app behind a layer that read the request's `body` whole: it gets the
    body first, then what the client sends next (a disconnect)."""
    replay = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return replay.pop() if replay else await receive()

    return replayed
