"""One trainer per run: rank 0 holds the run's trainer lease in Redis while it trains.

A second trainer on a running run (a service scaled to two, a rolling update that starts the new
trainer before the old one stops, a `tandem trainer` started by hand with the same --save) resumes
from the same checkpoint folder and reads from the same consumer group: each trains on part of the
groups, both publish the same version numbers with different weights (the engines serve a mix:
log-prob differences of ~10 were measured) and both save into one folder. So rank 0 joins the run
(`sample_buffer.membership`) before it writes anything: the lease, taken or refused (exit 2) as
there, renewed by a thread (a step of minutes does not hold it up). A trainer that finds another
one holding it (it was stopped, or cut off from Redis, for longer than the expiry, and another
started) ends at once, exit 1, without a save: the other one trains this run now, and Redis
refuses this one's steps and drops meanwhile (`ledger.FENCE`). A trainer that stops gives the
lease up. The same membership agrees the trainer's terms of the run contract as it joins and
writes its status (`status.StatusReporter`).
"""

from __future__ import annotations

import os
import sys

from services.sample_buffer import SampleBuffer
from services.sample_buffer.membership import Membership


def trainer_membership(buffer: SampleBuffer) -> Membership:
    """The trainer role in `buffer`'s run (`Membership`), saying what a start waits for."""
    return Membership(buffer, "trainer", lambda said: print(f"[trainer] {said}", flush=True))


def end_on_lost(member: Membership) -> None:
    """Another trainer holds the lease: end the process (the intake waits a Redis out)."""
    print(f"[trainer] {member.lost()}: it ends now, without a save", file=sys.stderr, flush=True)
    os._exit(1)
