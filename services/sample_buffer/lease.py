"""A run's lease of one role (`keys.LEASE_*`), held by this process through a `SampleBuffer`:
the trainer's and the weight broker's (the router's is async: `services/rollout_router/lease.py`).

`wait` takes the lease (or, not taking it, waits until nobody holds it): a lease left by a
process killed just now expires within `LEASE_TTL_S`, so a start waits at most `LEASE_WAIT_S`;
one still renewed is another's, and the start is refused (ValueError: exit 2) naming it. The
holder renews it every `LEASE_RENEW_S` (`renew` names another holder once one took it over), from
a thread of its own (`renew_in_thread`: a busy event loop or a step of minutes does not hold it
up; a router's start-up had outlasted the expiry before its renewing began, and another router
took the run), and gives it up when it stops (`release`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.sample_buffer.buffer import SampleBuffer
from services.sample_buffer.keys import (
    LEASE_RENEW_S,
    LEASE_TTL_S,
    LEASE_WAIT_S,
    lease_held,
    lease_owner_name,
    lease_waiting,
)


class Lease:
    """The `role` lease of `buffer`'s run; `say` prints what a start waits for."""

    def __init__(self, buffer: SampleBuffer, role: str, say: Callable[[str], None]) -> None:
        self.buffer, self.role, self.say = buffer, role, say
        self.key, self.owner = buffer.lease_prefix + role, lease_owner_name(role)
        self.held = False
        self.stopped = threading.Event()
        self.renewer: threading.Thread | None = None
        self.lost_to = ""  # the process that took the lease over (set by `renew_in_thread`)

    def wait(self, take: bool = True) -> None:
        """Until no other process holds the lease (and this one does, with `take`): a holder
        that does not renew it within `LEASE_WAIT_S` lets it go; ValueError naming one that
        does."""
        deadline, said = time.monotonic() + LEASE_WAIT_S, False
        while holder := self.renew() if take else (self.buffer.redis.get(self.key) or b"").decode():
            if time.monotonic() >= deadline:
                raise ValueError(lease_held(self.role, self.buffer.config.run_id, holder))
            if not said:
                self.say(lease_waiting(self.role, self.buffer.config.run_id, holder))
                said = True
            time.sleep(LEASE_RENEW_S / 2)
        self.held = self.held or take

    def renew(self) -> str:
        """Hold the lease `LEASE_TTL_S` more: '' when done, else who holds it (then this
        process no longer does: `release` leaves it to them). RedisError passes."""
        holder = self.buffer.take_lease(self.role, self.owner, LEASE_TTL_S)
        self.held = self.held and not holder
        return holder

    def renew_in_thread(self, on_lost: Callable[[str], None]) -> None:
        """Renew the lease from a thread until `release`; `on_lost(holder)` (in that thread)
        once another holds it. A Redis that does not answer is the service's to report: the
        lease is renewed (taken again, when nobody took it meanwhile) once it answers."""
        self.renewer = threading.Thread(
            target=self._renew, args=(on_lost,), name=f"{self.role} lease", daemon=True
        )
        self.renewer.start()

    def _renew(self, on_lost: Callable[[str], None]) -> None:
        while not self.stopped.wait(LEASE_RENEW_S):
            try:
                holder = self.renew()
            except RedisError:
                continue
            if holder:
                self.lost_to = holder
                if not self.stopped.is_set():
                    on_lost(holder)
                return

    def release(self) -> str:
        """Stop renewing and give the lease up (when held); what went wrong ('' when nothing
        did)."""
        self.stopped.set()
        if self.renewer is not None:  # (a renewal under way would take it again)
            self.renewer.join(LEASE_TTL_S)
        if not self.held:
            return ""
        self.held = False
        try:
            self.buffer.release_lease(self.role, self.owner)
        except RedisError as exc:  # it expires by itself
            return f"{self.role} lease not given up ({exc}): it expires in {LEASE_TTL_S:g} s"
        return ""
