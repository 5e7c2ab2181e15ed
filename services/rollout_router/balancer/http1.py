"""A minimal keep-alive HTTP/1.1 client for the forwarding hot path (POST bytes, read bytes).

Why: per forwarded request the router's CPU went about one third into aiohttp's client
machinery; this client does only what forwarding needs (one request at a time per connection,
a pool of idle connections per worker, `httptools` for parsing) and measured cheaper in
`bench/router_overhead.py` (which also compares it with aiohttp and httpx). Everything else
(health checks, streaming, fan-out, environments) keeps using aiohttp.

Failure modes, all raised as `ConnectionError` subclasses or `TimeoutError` so the caller's
retry logic treats them as "no answer": refused or reset connections, a connection closed
before a complete response, an unparsable response, and the per-request timeout. A reused idle
connection that the server had closed is retried once on a fresh connection before any byte of
the answer arrived (the request never reached the server), and so is one whose transport had
closed before its loss was delivered (uvloop then raises RuntimeError on the write).
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlsplit

import httptools


class ResponseError(ConnectionError):
    """The connection broke or the answer could not be parsed."""


class _Connection(asyncio.Protocol):
    """One TCP connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.chunks: list[bytes] = []
        self.closed = False
        self.received = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ResponseError(f"bad HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ResponseError(f"connection closed before a full response ({exc})"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), b"".join(self.chunks)))
        if not self.parser.should_keep_alive():
            self.close()

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, head: bytes, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.chunks, self.received = [], False
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            self.transport.writelines((head, body))
        except RuntimeError as exc:  # uvloop: the transport closed before its loss reached us
            self.closed = True
            raise ResponseError(f"connection closed before the request was sent ({exc})") from None
        return self.waiter


class Http1Pool:
    """Idle connections per (host, port); `post()` sends one request and returns (status, body)."""

    def __init__(self, timeout_s: float, max_idle_per_host: int = 256) -> None:
        self.timeout_s = timeout_s
        self.max_idle = max_idle_per_host
        self.idle: dict[str, deque[_Connection]] = {}

    async def post(self, base_url: str, path: str, body: bytes) -> tuple[int, bytes]:
        parts = urlsplit(base_url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        idle = self.idle.setdefault(base_url, deque())
        while idle:  # a reused connection may have been closed by the server meanwhile
            conn = idle.pop()
            if conn.closed:
                continue
            try:
                return await self._exchange(conn, head, body, idle)
            except ResponseError:
                if conn.received:  # the server answered something: do not send twice
                    raise
        loop = asyncio.get_running_loop()
        try:
            _transport, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, host, port), self.timeout_s
            )
        except OSError as exc:
            raise ResponseError(f"cannot connect to {base_url}: {exc}") from exc
        return await self._exchange(conn, head, body, idle)

    async def _exchange(
        self, conn: _Connection, head: bytes, body: bytes, idle: deque[_Connection]
    ) -> tuple[int, bytes]:
        waiter = conn.send(head, body)
        timer = asyncio.get_running_loop().call_later(
            self.timeout_s, conn._fail, TimeoutError(f"no answer in {self.timeout_s:.0f}s")
        )
        try:
            result = await waiter
        except BaseException:
            conn.close()  # cancelled or failed mid-request: the connection state is unknown
            raise
        finally:
            timer.cancel()
        if not conn.closed and len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()
        return result

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()
