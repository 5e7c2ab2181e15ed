"""One engine as the router's pool sees it (`Worker`), the errors of requests to engines, and
the choice of a session's engine (`rendezvous`). The pool itself is workers.py.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from services.common.serving import ServiceError


class NoWorkerError(RuntimeError):
    """No admitted worker can take the request."""


class EngineStartupError(ServiceError):
    """An engine never answered during start-up."""


class EngineRequestError(RuntimeError):
    """A request failed on every attempt; `status` is the last HTTP status (0 = no answer)."""

    def __init__(self, message: str, status: int = 0, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Worker:
    """One engine as the pool sees it."""

    url: str
    worker_id: str
    healthy: bool = True
    outstanding: int = 0
    weight_version: int = -1
    failures: int = 0
    requests: int = 0
    errors: int = 0
    last_error: str = ""
    refused: str = ""  # why it gets no traffic whatever its health (engine_context.py)
    model_info: dict[str, Any] = field(default_factory=dict)
    broker_asked_at: float = -math.inf  # monotonic time of the last POST {broker}/engines
    behind_since: float = 0.0  # monotonic time it first served an older version than the pool's
    waiting: set[asyncio.Task[Any]] = field(default_factory=set)  # tasks awaiting its answer
    quiet_since: float = 0.0  # monotonic: its last answer, or the request that ended its idling
    heard_at: float = 0.0  # monotonic: its last answer of any kind (a request, a probe)
    answer_s: float = 0.0  # its slowest recent answer to GET /model_info (decaying)

    def hold(self) -> None:
        """One more request sent to it; from idle, its silence starts now."""
        if not self.outstanding:
            self.quiet_since = time.monotonic()
        self.outstanding += 1
        self.requests += 1

    def heard(self, asked_at: float) -> None:
        """It answered a GET /model_info sent at `asked_at` (monotonic)."""
        self.heard_at = time.monotonic()
        self.answer_s = max(self.heard_at - asked_at, 0.8 * self.answer_s)

    def silent_s(self) -> float:
        """Seconds it has held requests without answering any (0 when it holds none)."""
        return time.monotonic() - self.quiet_since if self.outstanding else 0.0

    def unanswered_s(self) -> float:
        """Seconds it has held requests and answered nothing, neither them nor a probe."""
        return time.monotonic() - max(self.quiet_since, self.heard_at) if self.outstanding else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.worker_id,
            "url": self.url,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "weight_version": self.weight_version,
            "requests": self.requests,
            "errors": self.errors,
            "last_error": self.last_error,
            "refused": self.refused,
        }


def worker_id_for(url: str) -> str:
    return f"w{zlib.crc32(url.encode()):08x}"


def rendezvous(workers: list[Worker], key: str) -> Worker:
    """Highest-random-weight hashing: a session keeps its worker while that worker stays up, and
    only the sessions of a removed worker move."""
    return max(workers, key=lambda w: zlib.crc32(f"{w.url}|{key}".encode()))
