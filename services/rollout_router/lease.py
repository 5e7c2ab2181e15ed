"""One router per run: the router that writes a run's samples holds its lease in Redis.

A second router on the same run (a second `tandem router` by hand, a compose service scaled to
two, a rolling update that starts the new router before the old one stops) would drop the
first one's groups in flight as left by a dead router and draw their prompts again while the
first still puts them (the same group trained twice), and both would run the demand gate on
the same counters (twice the rollouts, dropped as stale). So the router takes the lease before
it writes anything (`take`): a lease left by a router killed just now expires within
`LEASE_TTL_S`, so a restart waits at most `LEASE_WAIT_S`; one still renewed is another router's,
and this one exits naming it. While it runs, `keep` renews it every `LEASE_RENEW_S`; a router
that finds another one holding it (it was stopped, or cut off from Redis, for longer than the
expiry, and another took over) stops its rollouts and fails its `/health`, and Redis refuses
its writes meanwhile (`ledger.FENCE`). A router that stops gives the lease up (`release`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from services.sample_buffer import AsyncSampleBuffer
from services.sample_buffer.keys import (
    LEASE_RENEW_S,
    LEASE_TTL_S,
    LEASE_WAIT_S,
    lease_held,
    lease_lost,
    lease_owner_name,
    lease_waiting,
)

ROLE = "router"

log = logging.getLogger("tandem.router")


class LeaseError(ValueError):
    """Another router holds the run's lease (at start: a configuration error, exit 2)."""


class RouterLease:
    """The router lease of `buffer`'s run, held by this process."""

    def __init__(self, buffer: AsyncSampleBuffer) -> None:
        self.buffer, self.run_id = buffer, buffer.config.run_id
        self.owner = lease_owner_name(ROLE)
        self.held = False
        # its writes are refused once another router holds the lease
        buffer.lease_key, buffer.lease_owner = buffer.lease_prefix + ROLE, self.owner

    async def take(self) -> None:
        """Hold the lease (a holder that does not renew it within `LEASE_WAIT_S` lets it go);
        `LeaseError` naming the holder when it does."""
        deadline, said = time.monotonic() + LEASE_WAIT_S, False
        while holder := await self.buffer.take_lease(ROLE, self.owner, LEASE_TTL_S):
            if time.monotonic() >= deadline:
                raise LeaseError(lease_held(ROLE, self.run_id, holder))
            if not said:
                log.warning("%s", lease_waiting(ROLE, self.run_id, holder))
                said = True
            await asyncio.sleep(LEASE_RENEW_S / 2)
        self.held = True

    async def keep(self) -> None:
        """Renew the lease until cancelled; `LeaseError` once another router holds it. A
        Redis that does not answer is the rollout's to report: the lease is renewed (taken
        again, when nobody took it meanwhile) once it answers."""
        while True:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                holder = await self.buffer.take_lease(ROLE, self.owner, LEASE_TTL_S)
            except RedisError:
                continue
            if holder:
                raise LeaseError(lease_lost(ROLE, self.run_id, holder))

    async def release(self) -> None:
        """Give the lease up (when this router took it)."""
        if not self.held:
            return
        try:
            await self.buffer.release_lease(ROLE, self.owner)
        except RedisError as exc:  # it expires by itself
            log.warning("router lease not given up (%s): it expires in %g s", exc, LEASE_TTL_S)
