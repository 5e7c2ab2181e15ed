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

from services.sample_buffer import SampleBuffer
from services.sample_buffer.keys import lease_lost
from services.sample_buffer.lease import Lease

ROLE = "trainer"


class TrainerLease:
    """The trainer lease of `buffer`'s run, held by this process (rank 0)."""

    def __init__(self, buffer: SampleBuffer) -> None:
        self.lease = Lease(buffer, ROLE, lambda said: print(f"[trainer] {said}", flush=True))
        self.run_id = buffer.config.run_id

    def fence(self, buffer: SampleBuffer) -> None:
        """Make `buffer`'s ledger writes refused once another trainer holds the lease."""
        buffer.lease_key, buffer.lease_owner = self.lease.key, self.lease.owner

    def wait_free(self) -> None:
        """Wait until no other trainer holds the lease, without taking it: the check before
        anything is loaded. ValueError naming the holder (`Lease.wait`)."""
        self.lease.wait(take=False)

    def take(self) -> None:
        """Hold the lease, then renew it in a thread. ValueError naming the holder."""
        self.lease.wait()
        self.lease.renew_in_thread(self._lost)

    def _lost(self, holder: str) -> None:
        """Another trainer holds the lease: end the process (the intake waits a Redis out)."""
        lost = lease_lost(ROLE, self.run_id, holder)
        print(f"[trainer] {lost}: it ends now, without a save", file=sys.stderr, flush=True)
        os._exit(1)

    def release(self) -> None:
        """Stop renewing and give the lease up (when taken)."""
        if problem := self.lease.release():
            print(f"[trainer] {problem}", flush=True)
