"""The run's timeline: coarse spans (a rollout batch, a train step's phases, a weight sync) that
every service appends to one capped Redis stream, `tandem:{run_id}:timeline`, and that
`chrome_trace` turns into a Chrome-trace / Perfetto JSON (`tandem timeline`, `tandem up`).

`Timeline.span` only appends to an in-memory deque (bounded: `PENDING_MAX`, the oldest spans
are dropped and counted when Redis is away), so callers on an event loop or in a training step
never wait for Redis; a daemon thread writes the pending spans every `flush_s` in one pipeline.
`close()` writes what is left. The stream keeps the newest `TIMELINE_LEN` spans: spans are per
batch, step or sync, so that is hours of a run at a few KB per minute.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

log = logging.getLogger("tandem.timeline")
TIMELINE_LEN = 50_000
PENDING_MAX = 10_000


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def timeline_key(run_id: str) -> str:
    return f"tandem:{run_id}:timeline"


class Timeline:
    """Span writer of one service (`source`: router, trainer, broker, engine...)."""

    def __init__(self, client: redis.Redis, run_id: str, source: str, flush_s: float = 0.5):
        self.redis, self.key, self.source = client, timeline_key(run_id), source
        self.pending: collections.deque[bytes] = collections.deque(maxlen=PENDING_MAX)
        self.lost = 0  # spans not written because Redis failed
        self._stop = threading.Event()
        self._flush_s = flush_s
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self._thread.start()

    def add(self, name: str, start: float, end: float, lane: str = "main", **args: Any) -> None:
        """One span from wall-clock `start` to `end` (seconds since the epoch) on `lane`."""
        event = {"source": self.source, "lane": lane, "name": name, "start": start, "end": end}
        if args:  # NaN is no JSON (Perfetto refuses the file): it becomes null
            event["args"] = {k: _finite(v) for k, v in args.items()}
        self.pending.append(json.dumps(event).encode())

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "main", **args: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time(), lane, **args)

    def flush(self) -> None:
        batch = []
        while self.pending:
            batch.append(self.pending.popleft())
        if not batch:
            return
        pipe = self.redis.pipeline(transaction=False)
        for data in batch:
            pipe.xadd(self.key, {"d": data}, maxlen=TIMELINE_LEN, approximate=True)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            self.lost += len(batch)
            log.warning("timeline: %d spans not written (%s)", len(batch), exc)

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.flush()


def read_spans(client: redis.Redis, run_id: str) -> list[dict[str, Any]]:
    """Every span the stream still holds, oldest first."""
    spans: list[dict[str, Any]] = []
    last = "-"
    while True:
        entries = client.xrange(timeline_key(run_id), min=last, count=5000)
        if last != "-":
            entries = entries[1:]  # `min` is inclusive: the first entry was read already
        if not entries:
            return spans
        spans += [json.loads(fields[b"d"]) for _, fields in entries]
        last = entries[-1][0]


def chrome_trace(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome-trace JSON: one process per source, one thread per lane, "X" complete events in
    microseconds from the first span (Perfetto and chrome://tracing open it)."""
    origin = min((s["start"] for s in spans), default=0.0)
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    events: list[dict[str, Any]] = []
    for s in sorted(spans, key=lambda s: s["start"]):
        pid = pids.setdefault(s["source"], len(pids) + 1)
        tid = tids.setdefault((s["source"], s["lane"]), len(tids) + 1)
        events.append(
            {
                "name": s["name"],
                "cat": s["source"],
                "ph": "X",
                "ts": round((s["start"] - origin) * 1e6, 1),
                "dur": round(max(s["end"] - s["start"], 0.0) * 1e6, 1),
                "pid": pid,
                "tid": tid,
                "args": s.get("args", {}),
            }
        )
    meta = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": source}}
        for source, pid in pids.items()
    ]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": pids[src], "tid": tid, "args": {"name": lane}}
        for (src, lane), tid in tids.items()
    ]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": {"origin": origin}}
