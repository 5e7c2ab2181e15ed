"""A bounded soak of the router's forwarding path: 10,000 requests, 1,000 in flight at a time,
through a real router process to two stand-in engines over loopback. No errors, and the router's
memory stays flat once warm (its RSS after each 1,000 requests is printed)."""

from __future__ import annotations

import asyncio

import aiohttp
import psutil

from tests.test_router_workers import GEN, start_router

TOTAL, IN_FLIGHT, EVERY = 10_000, 1_000, 1_000


async def soak(url: str, rss: list[float], pid: int) -> list[int]:
    statuses: list[int] = []
    limit = asyncio.Semaphore(IN_FLIGHT)
    connector = aiohttp.TCPConnector(limit=IN_FLIGHT)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with limit, session.post(url + "/generate", json=GEN) as resp:
                await resp.read()
                statuses.append(resp.status)
                if len(statuses) % EVERY == 0:
                    rss.append(psutil.Process(pid).memory_info().rss / 2**20)

        await asyncio.gather(*(one() for _ in range(TOTAL)))
    return statuses


def test_ten_thousand_requests_through_the_router_with_no_error_and_flat_memory(
    buffer, start_service, engines
) -> None:
    router = start_router(start_service, buffer, [engines().url, engines().url])
    rss: list[float] = []
    statuses = asyncio.run(soak(router.url, rss, router.proc.pid))
    print("router RSS (MiB) after each 1,000 requests:", " ".join(f"{m:.0f}" for m in rss))
    errors = [s for s in statuses if s != 200]
    assert len(statuses) == TOTAL and not errors, f"{len(errors)} errors: {set(errors)}"
    warm, end = rss[2], rss[-1]
    assert end - warm < 40, f"router RSS grew {end - warm:.0f} MiB after warm-up: {rss}"
