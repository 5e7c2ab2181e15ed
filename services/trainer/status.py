"""The trainer's `ServiceStatus` in Redis: what it does now and what it waits for.

`StatusReporter.update()` is called by the training loop at each change of state (and in the
read loop each time a blocking read wakes, at least every `read_block_ms`); it writes at once when
the state or the wait changed, otherwise at most every `interval_s`. A daemon thread rewrites the
current status every `interval_s` too, so the record stays fresh while the loop is blocked in one
long call (a weight transfer, a checkpoint save). Each write goes through the trainer's run
membership (`Membership.report`). Rank 0 only: the other ranks hold no buffer.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis

from proto.contract import ServiceStatus
from services.common.long_wait import LongWait
from services.sample_buffer.membership import Membership

log = logging.getLogger("tandem.trainer")


class StatusReporter:
    """Writes `ServiceStatus(role="trainer")` through `member` (`Membership.report`)."""

    def __init__(self, member: Membership, interval_s: float = 2.0) -> None:
        self.member = member
        self.interval_s = interval_s
        self.ttl_s = max(30.0, 10 * interval_s)  # several missed refreshes before it expires
        self.status = ServiceStatus(role="trainer", state="starting", pid=os.getpid())
        self.last_write = 0.0
        self.failing = False  # the last write failed
        self.state_since = time.time()  # (the status's `since` is that of its wait)
        self.long_wait = LongWait(lambda line: print(f"[trainer] {line}", flush=True))
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._refresh, name="trainer-status", daemon=True)
        self.thread.start()

    def update(
        self, state: str, waiting_for: str = "", **detail: float | int | str
    ) -> ServiceStatus:
        """Report `state`; `waiting_for` empty = not waiting. Returns the status as written."""
        with self.lock:
            changed = (state, waiting_for) != (self.status.state, self.status.waiting_for)
            if state != self.status.state:
                self.state_since = time.time()
            if changed:
                self.status.since = time.time()
            self.status.state, self.status.waiting_for = state, waiting_for
            self.status.detail = dict(detail)
            if changed or time.monotonic() - self.last_write >= self.interval_s:
                self._write()
            return self.status

    def _write(self) -> None:
        self.status.updated_at = time.time()
        try:
            self.member.report(self.status, self.ttl_s)
        except redis.RedisError as exc:  # a status is best effort; the next refresh retries
            if not self.failing:  # (once a streak: it was said every 2 s of a Redis outage)
                log.warning(
                    "trainer status not written (retried every %gs): %s", self.interval_s, exc
                )
            self.failing = True
        else:
            if self.failing:
                log.warning("trainer status written again")
            self.failing = False
        self.last_write = time.monotonic()

    def _refresh(self) -> None:
        while not self.stopped.wait(self.interval_s):
            with self.lock:
                if time.monotonic() - self.last_write >= self.interval_s * 0.9:
                    self._write()
                self.long_wait.check(self.status.state, self.status.waiting_for, self.state_since)

    def close(self, state: str = "stopped", error: str = "") -> None:
        """Stop refreshing and leave a last status (`error` set when the run failed)."""
        self.stopped.set()
        self.thread.join(timeout=5)
        with self.lock:
            self.status.state, self.status.waiting_for, self.status.error = state, "", error
            self._write()
