"""`tandem up`'s progress watchdog: a run makes progress or says what it waits for.

Two checks, both run from the launcher's monitor loop (no thread of their own):
- Health: every `HEALTH_INTERVAL_S`, `GET /health` of each HTTP service (router, broker). A
  service whose main loop died answers 503 with its error, a dead one refuses the connection;
  two such checks in a row end the run, naming the service, its answer and its log. A service
  that accepts the connection but does not answer (paused with SIGSTOP, swapping, overloaded)
  may come back: the watchdog says so at once and again when it answers, and ends the run only
  when it stays silent for `stall_fail_s`.
- Stall: when no trainer step has completed and the trainer got no new group for its next
  step (its status's `groups_in_hand`, read with the health checks: a first rollout of a real
  model may take longer than `stall_warn_s`, and is progress; groups put and dropped are not)
  for `stall_warn_s`, print what each service waits for (the `ServiceStatus` records they keep
  in Redis, `proto/contract.py`), again every `stall_warn_s` while the stall lasts; after
  `stall_fail_s` end the run with that diagnosis. A rollout paused or stopped on request
  (`POST /rollout/pause`, `/rollout/stop`, the dashboard) is no stall: the operator asked for
  it, and it ended a run they meant to resume. The watchdog says so when it begins, every
  `stall_warn_s` while it lasts and when it ends; the stall clock starts again at its end.

Knows: the status records and the health routes. Does not know why a service waits: each
service says that itself, in words a user can act on.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from redis.exceptions import RedisError

from proto.contract import ServiceStatus
from services.sample_buffer import SampleBuffer
from services.sample_buffer.store_check import memory_note

HEALTH_INTERVAL_S = 2.0
HEALTH_FAILURES = 2  # in a row: one slow answer under load is not a death
HEALTH_TIMEOUT_S = 3.0
ROLES = ("trainer", "router", "broker")
HELD = ("paused", "stopped")  # the router's loop, with what starts it again: held on request


def health_problem(url: str) -> tuple[str, bool]:
    """("", False) when `GET url/health` answers 200; else what it answered (or why it did not)
    and whether it was silent (connected, no answer within `HEALTH_TIMEOUT_S`) rather than failed."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=HEALTH_TIMEOUT_S) as resp:
            return ("" if resp.status == 200 else f"HTTP {resp.status}"), False
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:500]
        with contextlib.suppress(ValueError, AttributeError):
            body = json.loads(body).get("error") or body
        return f"HTTP {exc.code}: {body}", False
    except urllib.error.URLError as exc:
        return f"no answer ({exc.reason})", isinstance(exc.reason, TimeoutError)
    except (OSError, TimeoutError) as exc:
        return f"no answer ({exc})", isinstance(exc, TimeoutError)


def diagnosis(statuses: dict[str, ServiceStatus], now: float, store: str = "") -> list[str]:
    """One line per service: what it waits for and for how long. `store`: why Redis is the
    cause, said for a service whose status is missing (its write was refused)."""
    lines = []
    for role in [*ROLES, *sorted(set(statuses) - set(ROLES))]:
        status = statuses.get(role)
        if status is None:
            why = store or f"starting, or stuck: see logs/{role}.log"
            lines.append(f"  {role}: no status reported in the last 30 s ({why})")
            continue
        waited = f", {now - status.since:.0f} s" if status.since else ""
        what = f"waits for {status.waiting_for}" if status.waiting_for else "is not waiting"
        if status.state == "training" and "step" in status.detail:  # (a long step on a CPU)
            what = f"is training step {status.detail['step']}"
        if busy := not status.waiting_for and status.detail.get("busy"):
            what = f"is busy with {busy}"
        error = f"; error: {status.error}" if status.error else ""
        note = f"; {status.detail['note']}" if status.detail.get("note") else ""
        lines.append(f"  {role} [{status.state}{waited}]: {what}{error}{note}")
    return lines


class Watchdog:
    """Health and stall checks of one run; `check()` returns why the run must end, or ""."""

    def __init__(
        self,
        buffer: SampleBuffer,
        health_urls: dict[str, str],
        stall_warn_s: float,
        stall_fail_s: float,
        say: Callable[[str], None],
        max_steps: int = 0,
    ) -> None:
        self.buffer = buffer
        self.max_steps = max_steps  # past it, the trainer is ending (saving, closing)
        self.health_urls = health_urls
        self.stall_warn_s, self.stall_fail_s = stall_warn_s, stall_fail_s
        self.say = say
        self.last_step_at = self.last_warned_at = time.monotonic()
        self.last_health_at = 0.0
        self.failures = dict.fromkeys(health_urls, 0)
        self.silent_since: dict[str, float] = {}
        self.last_step = 0
        self.in_hand = -1  # the trainer's groups for its next step at the last look
        self.held_since = 0.0  # when the rollout was seen held on request (0: it is not)

    def step_done(self, step: int) -> None:
        self.last_step_at = time.monotonic()
        self.last_step = step

    def progressing(self) -> bool:
        """Whether the run is not stalled: the trainer holds more groups for its next step than
        at the last look (its status's `groups_in_hand`; False when Redis does not answer: its
        outage is said elsewhere), or the rollout is held on request (`held`). Groups put and
        then dropped are no progress."""
        try:
            statuses = self.buffer.statuses()
        except RedisError:
            return False
        trainer = statuses.get("trainer")
        in_hand = int(trainer.detail.get("groups_in_hand", 0)) if trainer else 0
        arrived, self.in_hand = in_hand > self.in_hand >= 0, in_hand
        return self.held(statuses.get("router")) or arrived

    def held(self, router: ServiceStatus | None) -> bool:
        """Whether the router's rollout is paused or stopped on request, or was until now; said
        when that begins, every `stall_warn_s` while it lasts and when it ends."""
        now = time.monotonic()
        if router is None or router.state not in HELD or not router.waiting_for:
            if not self.held_since:
                return False
            self.say(f"rollout goes on after {now - self.held_since:.0f} s held on request")
            self.held_since = 0.0
            return True  # (the wait for progress starts now, not at the last look while held)
        if not self.held_since:
            self.held_since = self.last_warned_at = now
            self.say(
                f"rollout {router.state} on request: the run waits for {router.waiting_for}; "
                "no progress is expected, and none is asked for (--stall-fail-s) until it goes on"
            )
        elif now - self.last_warned_at >= self.stall_warn_s:
            self.last_warned_at = now
            waited = now - self.held_since
            self.say(f"rollout {router.state} on request for {waited:.0f} s: {router.waiting_for}")
        return True

    def check(self) -> str:
        now = time.monotonic()
        if now - self.last_health_at >= HEALTH_INTERVAL_S:
            self.last_health_at = now
            problem = self._health()
            if problem:
                return problem
            if self.progressing():  # a step is on its way, or none is asked for
                self.last_step_at = now
        stalled = now - self.last_step_at
        if stalled < min(self.stall_warn_s, self.stall_fail_s):  # (a fail bound under the
            return ""  # warning's ends the run at its own bound, not at the warning's)
        if self.max_steps and self.last_step >= self.max_steps:  # it saves and closes
            what = f"the trainer has not ended {stalled:.0f} s after its last step (saving, closing"
        else:
            what = f"no progress for {stalled:.0f} s (no trainer step, no new group in its hands"
        if stalled >= self.stall_fail_s:
            lines = self.report(stalled)
            return f"{what}; --stall-fail-s):\n" + "\n".join(lines)
        if now - self.last_warned_at >= self.stall_warn_s:
            self.last_warned_at = now
            self.say(f"{what}; last: step {self.last_step}); what each service waits for:")
            for line in self.report(stalled):
                self.say(line)
            self.say(
                f"(the run ends after {self.stall_fail_s:.0f} s without progress: --stall-fail-s)"
            )
        return ""

    def report(self, stalled: float) -> list[str]:
        try:
            statuses, refused = self.buffer.statuses(), self.buffer.write_refused()
            full = memory_note(self.buffer.redis)
        except RedisError as exc:
            return [f"  redis: unreachable ({exc}); every service keeps its state there"]
        # (no service's status is written then: each would read "no status reported")
        said = (
            [f"  redis: refuses writes ({refused}); every service waits for it"] if refused else []
        )
        said = said or ([f"  redis: {full}"] if full else [])  # (refused: said there)
        store = "Redis is the cause: see the redis line" if said else ""
        return said + diagnosis(statuses, time.time(), store)

    def _health(self) -> str:
        for name, url in self.health_urls.items():
            problem, silent = health_problem(url)
            if silent:
                self.failures[name] = 0
                if problem := self._silent(name, url, problem):
                    return problem
                continue
            if name in self.silent_since:
                waited = time.monotonic() - self.silent_since.pop(name)
                self.say(f"{name} answers GET {url}/health again after {waited:.0f} s")
            self.failures[name] = self.failures[name] + 1 if problem else 0
            if self.failures[name] >= HEALTH_FAILURES:
                return f"{name} is unhealthy: GET {url}/health: {problem}"
        return ""

    def _silent(self, name: str, url: str, problem: str) -> str:
        """A service that takes connections but does not answer: say so once, end the run only
        after `stall_fail_s` of silence."""
        now = time.monotonic()
        since = self.silent_since.setdefault(name, now)
        if since == now:
            self.say(
                f"{name} does not answer GET {url}/health: {problem}; paused (SIGSTOP), swapping or"
                f" overloaded? The run ends if it stays silent for {self.stall_fail_s:.0f} s"
                " (--stall-fail-s)"
            )
        if now - since >= self.stall_fail_s:
            return f"{name} has not answered GET {url}/health for {now - since:.0f} s: {problem}"
        return ""
