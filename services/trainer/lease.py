"""One trainer per run: rank 0 holds the run's trainer lease in Redis while it trains.

A second trainer on a running run (a service scaled to two, a rolling update that starts the
new trainer before the old one stops, a `tandem trainer` started by hand with the same --save)
resumes from the same checkpoint folder and reads from the same consumer group: each trains on
part of the groups, both publish the same version numbers with different weights (the engines
serve a mix: log-prob differences of ~10 were measured) and both save into one folder. So rank 0
takes the lease before it writes anything (`take`): a lease left by a trainer killed just now
expires within `LEASE_TTL_S`, so a restart waits at most that long; one still renewed is another
trainer's, and this start is refused (ValueError: exit 2) naming it. A thread renews it every
`RENEW_S` (a step of minutes does not hold it up); a trainer that finds another one holding it
(it was stopped, or cut off from Redis, for longer than the expiry, and another started) ends at
once, exit 1, without a save: the other one trains this run now, and Redis refuses this one's
steps and drops meanwhile (`ledger.FENCE`). A trainer that stops gives the lease up.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from redis.exceptions import RedisError

from services.sample_buffer import SampleBuffer
from services.sample_buffer.keys import lease_owner_name

LEASE_TTL_S = 5.0  # how long a trainer that stopped renewing keeps the run
RENEW_S = 1.0
ROLE = "trainer"


class TrainerLease:
    """The trainer lease of `buffer`'s run, held by this process (rank 0)."""

    def __init__(self, buffer: SampleBuffer) -> None:
        self.buffer = buffer
        self.owner = lease_owner_name(ROLE)
        self.held = False
        self.stopped = threading.Event()

    def fence(self, buffer: SampleBuffer) -> None:
        """Make `buffer`'s ledger writes refused once another trainer holds the lease."""
        buffer.lease_key, buffer.lease_owner = buffer.lease_prefix + ROLE, self.owner

    def take(self, wait_s: float = LEASE_TTL_S + RENEW_S) -> None:
        """Hold the lease (a holder that does not renew it within `wait_s` lets it go), then
        renew it in a thread. ValueError naming the holder when it does."""
        deadline, said = time.monotonic() + wait_s, False
        while holder := self.buffer.take_lease(ROLE, self.owner, LEASE_TTL_S):
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"another trainer trains run {self.buffer.config.run_id}: {holder} (it "
                    f"renews its lease in Redis every {RENEW_S:g} s). One trainer per run: stop "
                    "that one, or give this one another --run-id"
                )
            if not said:
                print(
                    f"[trainer] waiting up to {wait_s:.0f} s for run "
                    f"{self.buffer.config.run_id}'s trainer lease, held by {holder} (one "
                    f"killed just now lets it go within {LEASE_TTL_S:g} s)",
                    flush=True,
                )
                said = True
            time.sleep(RENEW_S / 2)
        self.held = True
        threading.Thread(target=self._keep, name="trainer lease", daemon=True).start()

    def _keep(self) -> None:
        """Renew until released; end the process once another trainer holds the lease (a
        Redis that does not answer is the intake's to wait out: renewed once it answers)."""
        while not self.stopped.wait(RENEW_S):
            try:
                holder = self.buffer.take_lease(ROLE, self.owner, LEASE_TTL_S)
            except RedisError:
                continue
            if holder and not self.stopped.is_set():
                print(
                    f"[trainer] another trainer took run {self.buffer.config.run_id} over: "
                    f"{holder} (this one did not renew its lease for {LEASE_TTL_S:g} s: "
                    "stopped, or cut off from Redis); this one ends now, without a save",
                    file=sys.stderr,
                    flush=True,
                )
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
