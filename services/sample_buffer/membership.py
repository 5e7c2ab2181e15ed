"""A service's membership of a run in one role (trainer, router, broker): the role's lease, the
fence on its ledger writes, its terms of the run contract and its status writes, held by one
object.

Lease (`keys.LEASE_*`): `join` takes it (`wait_free` only waits until nobody holds it): a lease
left by a process killed just now expires within `LEASE_TTL_S`, so a start waits at most
`LEASE_WAIT_S`; one still renewed is another's, and the start is refused (ValueError: exit 2)
naming it. A thread of its own renews it every `LEASE_RENEW_S` (a busy event loop or a step of
minutes does not hold it up: a router's start-up had outlasted the expiry before its renewing
began, and another router took the run) and calls `on_lost(holder)` once another process holds
it; `release` gives it up when the service stops.
Fence: `fence(keys)` makes the ledger scripts run through `keys` (START, PUT, DROP, STEP) refuse
their writes once another process holds the lease (`ledger.FENCE`); `join` fences its own buffer.
Contract: `join` states the role's terms once the lease is held (`agree`, through
`SampleBuffer.agree_contract`: ContractMismatchError naming the flag; the lease is given up
then); `agree` states a term known only later (the router's prompts, once loaded) or, before
`join`, the terms a start checks before anything is loaded (the router's, before it serves).
Store: `join` checks what the run needs of Redis (`store_check`: an evicting Redis is refused,
one without persistence said) and reads the run's mark; the renewing thread checks the mark
before each renewal and, finding it gone or replaced (Redis restarted empty) or a counter that
only grows below what it read at the renewal before (`MONOTONE`, and those the member `watch`es:
the store rolled back), calls `on_lost` with `lost()` naming what was lost (the trainer then ends, exit 1).
Status: `report` writes the role's `ServiceStatus` (`SampleBuffer.set_status`, key
`status:<its role>`, gone after its TTL unless reported again); what it says, and when, is the
service's own loop's. It is written whether or not the lease is held (as a service's last word).
No service writes a status or states contract terms but through here (tests/test_house.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from proto.contract import RunContract, ServiceStatus
from services.sample_buffer.buffer import SampleBuffer
from services.sample_buffer.keys import (
    LEASE_RENEW_S,
    LEASE_TTL_S,
    LEASE_WAIT_S,
    BufferKeys,
    lease_held,
    lease_lost,
    lease_owner_name,
    lease_waiting,
)
from services.sample_buffer.store_check import claim_mark, store_lost, store_problems

# Counters that only grow while a run lives (a trainer's resume rewinds the consumed and trained
# counts and its version, never these): the prompt cursor, the groups started and put.
MONOTONE = ("prompts_drawn", "groups_generated", "groups_put")


def went_back(seen: dict[str, int], now: dict[str, int]) -> str:
    """The counters below what a member read before, said ('' when none is)."""
    back = ", ".join(f"{n} {seen[n]} -> {now[n]}" for n in seen if now[n] < seen[n])
    why = "an older snapshot restored, a failover to a replica behind it, or the counters edited"
    return f"its counters went back ({back}: {why})" if back else ""


class Membership:
    """`role` in `buffer`'s run, held by this process; `say` prints what a start waits for."""

    def __init__(self, buffer: SampleBuffer, role: str, say: Callable[[str], None]) -> None:
        self.buffer, self.role, self.say = buffer, role, say
        self.run_id = buffer.config.run_id
        self.key, self.owner = buffer.lease_prefix + role, lease_owner_name(role)
        self.held = False
        self.stopped = threading.Event()
        self.renewer: threading.Thread | None = None
        self.lost_to = ""  # the process that took the lease over (set by the renewing thread)
        self.mark, self.store_lost = b"", ""  # the run's mark; why the store lost the run
        self.seen: dict[str, int] = {}  # the `watched` counters as last read
        self.watched: tuple[str, ...] = MONOTONE  # (the renewing thread reads it as it stands)

    def join(
        self, on_lost: Callable[[str], None], contract: RunContract | None = None
    ) -> RunContract | None:
        """Take the lease (ValueError naming another holder), renew it in a thread, fence this
        buffer's writes with it, and agree `contract`. Returns the run's contract (None when
        none was given)."""
        refusal, warnings = store_problems(self.buffer.redis)
        if refusal:
            raise ValueError(refusal)
        for warning in warnings:
            self.say(warning)
        self.wait()
        self.mark = claim_mark(self.buffer.redis, self.buffer.mark_key)
        self.renew_in_thread(on_lost)
        self.fence(self.buffer)
        if contract is None:
            return None
        try:
            return self.agree(contract)
        except ValueError:
            self.release()
            raise

    def agree(self, contract: RunContract) -> RunContract:
        """State this role's terms `contract` (those the run has not yet are set) and check them
        against the run's: its whole contract as it stands; ContractMismatchError naming the
        flag. RedisError passes."""
        return self.buffer.agree_contract(contract, self.role)

    def report(self, status: ServiceStatus, ttl_s: float) -> None:
        """Write this role's `status`, gone after `ttl_s` unless reported again. RedisError
        passes (a status is the service's to retry)."""
        self.buffer.set_status(status, ttl_s)

    def fence(self, keys: BufferKeys) -> None:
        """Make the ledger writes through `keys` refused once another process holds the lease."""
        keys.lease_key, keys.lease_owner = self.key, self.owner

    def lost(self) -> str:
        """Why this service stops: the store lost the run, or who took the run over."""
        return self.store_lost or lease_lost(self.role, self.run_id, self.lost_to)

    def wait_free(self) -> None:
        """Wait until no other process holds the lease, without taking it (a check before
        anything is loaded). ValueError naming the holder."""
        self.wait(take=False)

    def wait(self, take: bool = True) -> None:
        """Until no other process holds the lease (and this one does, with `take`): a holder
        that does not renew it within `LEASE_WAIT_S` lets it go; ValueError naming one that
        does."""
        deadline, said = time.monotonic() + LEASE_WAIT_S, False
        while holder := self.renew() if take else (self.buffer.redis.get(self.key) or b"").decode():
            if time.monotonic() >= deadline:
                raise ValueError(lease_held(self.role, self.run_id, holder))
            if not said:
                self.say(lease_waiting(self.role, self.run_id, holder))
                said = True
            time.sleep(LEASE_RENEW_S / 2)
        self.held = self.held or take

    def renew(self) -> str:
        """Hold the lease `LEASE_TTL_S` more: '' when done, else who holds it (then this
        process no longer does: `release` leaves it to them). RedisError passes."""
        ttl_ms = int(LEASE_TTL_S * 1000)
        holder = self.buffer.scripts["lease"](keys=[self.key], args=[self.owner, ttl_ms]).decode()
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
                if self.mark and (lost := self.check_store()):
                    self.store_lost = lost
                    holder = "(none: the store lost the run)"
                else:
                    holder = self.renew()
            except RedisError:
                continue
            if holder:
                self.lost_to = holder
                if not self.stopped.is_set():
                    on_lost(holder)
                return

    def watch(self, *counters: str) -> None:
        """Check `counters` at each renewal too from now on: counters only this member moves
        (the trainer's consumed and trained counts, once its resume has rewound them)."""
        self.watched = (*self.watched, *counters)

    def check_store(self) -> str:
        """Why the store lost the run: its mark gone or replaced, or a `watched` counter below
        what this member read last time ('' when neither). One round trip; RedisError passes."""
        pipe, watched = self.buffer.redis.pipeline(transaction=True), self.watched
        pipe.get(self.buffer.mark_key)
        pipe.hmget(self.buffer.counters_key, watched)
        mark, values = pipe.execute()
        now = {name: int(value or 0) for name, value in zip(watched, values, strict=True)}
        url, key = self.buffer.config.redis_url, self.buffer.mark_key
        if mark != self.mark:
            return store_lost(url, key)
        back, self.seen = went_back(self.seen, now), now
        return store_lost(url, key, back) if back else ""

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
            self.buffer.scripts["release"](keys=[self.key], args=[self.owner])
        except RedisError as exc:  # it expires by itself
            return f"{self.role} lease not given up ({exc}): it expires in {LEASE_TTL_S:g} s"
        return ""
