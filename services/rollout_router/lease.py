"""One router per run: the router that writes a run's samples holds its lease in Redis.

A second router on the same run (a second `tandem router` by hand, a compose service scaled to
two, a rolling update that starts the new router before the old one stops) would drop the
first one's groups in flight as left by a dead router and draw their prompts again while the
first still puts them (the same group trained twice), and both would run the demand gate on
the same counters (twice the rollouts, dropped as stale). So the router takes the lease before
it writes anything (`take`, `sample_buffer.membership`): a lease left by a router killed just now expires within
`LEASE_TTL_S`, so a restart waits at most `LEASE_WAIT_S`; one still renewed is another router's,
and this one exits naming it. From the moment it is taken a thread renews it every
`LEASE_RENEW_S`: not the event loop, whose start-up (tokenizer, task, reward) took longer than
the expiry on a loaded machine, so another router found the lease free and both ran. A router
that finds another one holding it (it was stopped, or cut off from Redis, for longer than the
expiry, and another took over) stops its rollouts and fails its `/health` (`keep` raises), and
Redis refuses its writes meanwhile (`ledger.FENCE`). A router that stops gives the lease up
(`release`). The same run membership (`member`) states the prompts' term of the run contract once
they are loaded (`app.build_control`) and writes the router's status (`control.report_status`);
its other terms are agreed before it serves, by a membership not joined yet (`__main__.start`).
"""

from __future__ import annotations

import asyncio
import logging

from services.sample_buffer import AsyncSampleBuffer, SampleBuffer
from services.sample_buffer.keys import lease_lost
from services.sample_buffer.ledger import fenced_by
from services.sample_buffer.membership import Membership

ROLE = "router"

log = logging.getLogger("tandem.router")


class LeaseError(ValueError):
    """Another router holds the run's lease (at start: a configuration error, exit 2)."""


class RouterLease:
    """The router lease of `buffer`'s run, held by this process."""

    def __init__(self, buffer: AsyncSampleBuffer) -> None:
        self.member = Membership(
            SampleBuffer(buffer.config), ROLE, lambda said: log.warning("%s", said)
        )
        self.member.fence(buffer)  # its writes are refused once another router holds the lease
        self.lost = asyncio.Event()

    async def take(self) -> None:
        """Hold the lease (a holder that does not renew it within `LEASE_WAIT_S` lets it go),
        then renew it in a thread; `LeaseError` naming the holder when it does."""
        loop = asyncio.get_running_loop()

        def lost(_holder: str) -> None:  # (the lease's thread, which `release` ends first)
            loop.call_soon_threadsafe(self.lost.set)

        try:
            await asyncio.to_thread(self.member.join, lost)
        except ValueError as exc:
            raise LeaseError(str(exc)) from None

    async def keep(self) -> None:
        """Wait while the lease is held; `LeaseError` once another router holds it."""
        await self.lost.wait()
        raise LeaseError(self.member.lost())

    async def release(self) -> None:
        """Stop renewing and give the lease up (when this router took it)."""
        if problem := await asyncio.to_thread(self.member.release):
            log.warning("%s", problem)
        self.member.buffer.redis.close()


def raise_if_fenced(exc: BaseException | None, run_id: str) -> None:
    """`LeaseError` for a write Redis refused because another router holds the lease (FENCE):
    no outage to wait out, the run was taken over."""
    if holder := fenced_by(exc):
        raise LeaseError(lease_lost(ROLE, run_id, holder))
