"""One trainer per run: rank 0 holds the run's trainer lease in Redis while it trains.

A second trainer on a running run (a service scaled to two, a rolling update that starts the new
trainer before the old one stops, a `tandem trainer` started by hand with the same --save) resumes
from the same checkpoint folder and reads from the same consumer group: each trains on part of the
groups, both publish the same version numbers with different weights (the engines serve a mix:
log-prob differences of ~10 were measured) and both save into one folder. So rank 0 takes the lease
before it writes anything (`take`): a lease left by a trainer killed just now expires within
`LEASE_TTL_S`, so a restart waits at most `LEASE_WAIT_S`; one still renewed is another trainer's,
and this start is refused (ValueError: exit 2) naming it. A thread renews it every `LEASE_RENEW_S`
(a step of minutes does not hold it up); a trainer that finds another one holding it (it was
stopped, or cut off from Redis, for longer than the expiry, and another started) ends at once, exit
1, without a save: the other one trains this run now, and Redis refuses this one's steps and drops
meanwhile (`ledger.FENCE`). A trainer that stops gives the lease up.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.sample_buffer import SampleBuffer
from services.sample_buffer.keys import (
    LEASE_RENEW_S,
    LEASE_TTL_S,
    LEASE_WAIT_S,
    lease_held,
    lease_lost,
    lease_owner_name,
    lease_waiting,
)

ROLE = "trainer"


class TrainerLease:
    """The trainer lease of `buffer`'s run, held by this process (rank 0)."""

    def __init__(self, buffer: SampleBuffer) -> None:
        self.buffer, self.run_id = buffer, buffer.config.run_id
        self.owner = lease_owner_name(ROLE)
        self.held = False
        self.stopped = threading.Event()

    def fence(self, buffer: SampleBuffer) -> None:
        """Make `buffer`'s ledger writes refused once another trainer holds the lease."""
        buffer.lease_key, buffer.lease_owner = buffer.lease_prefix + ROLE, self.owner

    def wait_free(self) -> None:
        """Wait until no other trainer holds the lease, without taking it: the check before
        anything is loaded. ValueError naming the holder (`_wait`)."""
        self._wait(lambda: (self.buffer.redis.get(self.buffer.lease_prefix + ROLE) or b"").decode())

    def take(self) -> None:
        """Hold the lease, then renew it in a thread. ValueError naming the holder (`_wait`)."""
        self._wait(lambda: self.buffer.take_lease(ROLE, self.owner, LEASE_TTL_S))
        self.held = True
        threading.Thread(target=self._keep, name="trainer lease", daemon=True).start()

    def _wait(self, holder_now: Callable[[], str]) -> None:
        """Until `holder_now()` names no other trainer: a holder that does not renew the lease
        within `LEASE_WAIT_S` lets it go; ValueError naming the holder when it does."""
        deadline, said = time.monotonic() + LEASE_WAIT_S, False
        while holder := holder_now():
            if time.monotonic() >= deadline:
                raise ValueError(lease_held(ROLE, self.run_id, holder))
            if not said:
                print(f"[trainer] {lease_waiting(ROLE, self.run_id, holder)}", flush=True)
                said = True
            time.sleep(LEASE_RENEW_S / 2)

    def _keep(self) -> None:
        """Renew until released; end the process once another trainer holds the lease (a
        Redis that does not answer is the intake's to wait out: renewed once it answers)."""
        while not self.stopped.wait(LEASE_RENEW_S):
            try:
                holder = self.buffer.take_lease(ROLE, self.owner, LEASE_TTL_S)
            except RedisError:
                continue
            if holder and not self.stopped.is_set():
                lost = lease_lost(ROLE, self.run_id, holder)
                print(f"[trainer] {lost}: it ends now, without a save", file=sys.stderr, flush=True)
                os._exit(1)

    def release(self) -> None:
        """Stop renewing and give the lease up (when taken)."""
        self.stopped.set()
        if not self.held:
            return
        try:
            self.buffer.release_lease(ROLE, self.owner)
        except RedisError as exc:  # it expires by itself
            print(f"[trainer] lease not given up ({exc}): it expires in {LEASE_TTL_S:g} s")
