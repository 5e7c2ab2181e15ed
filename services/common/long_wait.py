"""A wait that lasts, said on a service's console.

Each service's status in Redis says what it waits for, and `tandem up`'s watchdog reads it; a
service run apart (as compose runs it) has only its console. `LongWait.check` says a wait of
`SAY_EVERY_S` in one state with what it waits for now, then again every `SAY_EVERY_S` while
the state lasts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SAY_EVERY_S = 60.0


class LongWait:
    """`say(line)` for each wait that lasts; states in `quiet` are no wait (never said)."""

    def __init__(self, say: Callable[[str], object], quiet: tuple[str, ...] = ()) -> None:
        self.say, self.quiet = say, quiet
        self.said_at = 0.0  # (wall-clock seconds, as a status's `since`)

    def check(self, state: str, waiting_for: str, since: float) -> None:
        """`since`: when `state` began (time.time())."""
        now = time.time()
        if not waiting_for or state in self.quiet or now - max(since, self.said_at) < SAY_EVERY_S:
            return
        self.said_at = now
        self.say(f"{state} for {now - since:.0f} s: waits for {waiting_for}")
