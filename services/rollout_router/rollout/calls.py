"""Calls in flight to something outside the router (a reward, an environment), and how long the
oldest has run: what a run that makes no progress is busy with (`report.busy`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class InFlight:
    """`with calls.one(): ...` around each call; `describe` says what is in flight."""

    def __init__(self, what: str, bound: str) -> None:
        self.what, self.bound = what, bound  # "calls to X", "--flag-timeout-s T"
        self.started: dict[int, float] = {}  # call -> when it started (monotonic)
        self.count = 0

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        self.count += 1
        call = self.count
        self.started[call] = time.monotonic()
        try:
            yield
        finally:
            del self.started[call]

    def describe(self) -> str:
        """'N calls to X in flight (the oldest S s; bound)', or "" when none is."""
        if not self.started:
            return ""
        oldest = time.monotonic() - min(self.started.values())
        return (
            f"{len(self.started)} {self.what} in flight (the oldest {oldest:.0f} s; {self.bound})"
        )
