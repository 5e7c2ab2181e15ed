"""The router's hot-path HTTP/1.1 client against a real aiohttp server on a real port."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from services.rollout_router.balancer.http1 import Http1Pool, ResponseError


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[int]]]:
    """Routes: /echo (body back, status from ?status=), /chunked, /close (Connection: close),
    /slow. The list collects the client port of each request (to see connection reuse)."""
    peers: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        status = int(request.query.get("status", 200))
        return web.Response(body=await request.read(), status=status)

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b"ab", b"cd", b"ef"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def close(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def slow(_request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(body=b"late")

    app = web.Application()
    for path, handler in (
        ("/echo", echo),
        ("/chunked", chunked),
        ("/close", close),
        ("/slow", slow),
    ):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, keepalive_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", peers
    await runner.cleanup()


async def test_bodies_and_statuses_pass_through_and_connections_are_reused(server):
    url, peers = server
    pool = Http1Pool(timeout_s=5)
    assert await pool.post(url, "/echo", b'{"a": 1}') == (200, b'{"a": 1}')
    assert await pool.post(url, "/echo?status=503", b"x" * 100_000) == (503, b"x" * 100_000)
    assert len(set(peers)) == 1, "the second request reused the first connection"
    pool.close()


async def test_chunked_answers_are_reassembled(server):
    url, _peers = server
    pool = Http1Pool(timeout_s=5)
    assert await pool.post(url, "/chunked", b"") == (200, b"abcdef")
    pool.close()


async def test_connection_close_answers_are_read_and_the_connection_not_reused(server):
    url, peers = server
    pool = Http1Pool(timeout_s=5)
    assert await pool.post(url, "/close", b"") == (200, b"bye")
    assert await pool.post(url, "/close", b"") == (200, b"bye")
    assert len(set(peers)) == 2
    pool.close()


async def test_an_idle_connection_closed_by_the_server_is_replaced_transparently(server):
    url, peers = server
    pool = Http1Pool(timeout_s=5)
    await pool.post(url, "/echo", b"1")
    await asyncio.sleep(0.6)  # past the server's keep-alive timeout: it closes the connection
    assert await pool.post(url, "/echo", b"2") == (200, b"2")
    assert len(set(peers)) == 2
    pool.close()


async def test_a_refused_connection_and_a_timeout_raise_what_the_retry_logic_expects(server):
    url, _peers = server
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    pool = Http1Pool(timeout_s=0.3)
    with pytest.raises(ResponseError, match="cannot connect"):
        await pool.post(dead, "/echo", b"")
    with pytest.raises(TimeoutError):
        await pool.post(url, "/slow", b"")
    assert await pool.post(url, "/echo", b"ok") == (200, b"ok"), "usable after a timeout"
    pool.close()


def test_a_connection_whose_transport_closed_before_its_loss_was_seen_is_replaced() -> None:
    """On uvloop (the loop the router serves on) a write to a transport closed under the
    connection raises RuntimeError, not an OSError: an engine killed between two requests made
    that escape the retry logic and end the rollout loop. It is a broken connection: replaced."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[int, bytes]:
        async def echo(request: web.Request) -> web.Response:
            return web.Response(body=await request.read())

        app = web.Application()
        app.router.add_post("/echo", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        pool = Http1Pool(timeout_s=5)
        try:
            await pool.post(url, "/echo", b"1")
            [idle] = pool.idle[url]
            assert idle.transport is not None
            # the transport closes, and its connection_lost has not reached the connection yet
            idle.connection_lost = lambda _exc: None  # type: ignore[method-assign]
            idle.transport.close()
            await asyncio.sleep(0.05)
            assert not idle.closed
            return await pool.post(url, "/echo", b"2")
        finally:
            pool.close()
            await runner.cleanup()

    assert uvloop.run(main()) == (200, b"2")
