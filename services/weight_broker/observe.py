"""The broker as an operator sees it: `/metrics` (a histogram of sync seconds, counts of syncs
and bytes, the broker's counters and each engine's state) and one timeline span per engine sync.

`SyncObserver.run()` (an asyncio task of the HTTP app) reads what the broker records when an
engine finishes a sync (`EngineState.last_sync_at`, `last_sync_s`, `last_bytes_per_s`) every
`poll_s`; it changes nothing in the broker, so the sync loop keeps no knowledge of it.
"""

from __future__ import annotations

import asyncio

from services.common.metrics import Gauge, Metrics, gauge, labels
from services.sample_buffer.timeline import Timeline
from services.weight_broker.broker import WeightBroker

ENGINE_GAUGES = {  # metric -> (EngineState attribute, help)
    "engine_version": ("version", "Weight version the engine serves (-1: unknown)."),
    "engine_in_rotation": ("in_rotation", "1 while the engine is in rotation."),
    "engine_last_sync_seconds": ("last_sync_s", "Seconds the engine's last sync took."),
    "engine_last_sync_bytes_per_second": ("last_bytes_per_s", "Bytes/s of the engine's last sync."),
    "engine_sync_failures": ("failures", "Syncs of the engine that failed."),
}


class SyncObserver:
    def __init__(self, broker: WeightBroker, poll_s: float = 0.1) -> None:
        self.broker, self.poll_s = broker, poll_s
        self.metrics = Metrics("tandem_broker_")
        self.metrics.counter("syncs", "Engine weight syncs that completed.")
        self.metrics.counter("synced_bytes", "Bytes of weights delivered to engines.")
        self.sync_seconds = self.metrics.histogram("sync_seconds", "Seconds per engine sync.")
        buffer = broker.buffer
        self.timeline = Timeline(buffer.redis, buffer.config.run_id, "broker") if buffer else None
        self.seen: dict[str, float] = {}  # engine url -> last_sync_at already counted

    def poll(self) -> None:
        for engine in list(self.broker.engines.values()):
            done_at = engine.last_sync_at
            if not done_at or self.seen.get(engine.url) == done_at:
                continue
            self.seen[engine.url] = done_at
            seconds = engine.last_sync_s
            self.metrics.inc("syncs")
            self.metrics.inc("synced_bytes", engine.last_bytes_per_s * seconds)
            self.sync_seconds.observe(seconds)
            if self.timeline is not None:
                self.timeline.add(
                    f"sync v{engine.version}",
                    done_at - seconds,
                    done_at,
                    engine.url,
                    version=engine.version,
                    gb_per_s=round(engine.last_bytes_per_s / 1e9, 3),
                )

    def render(self) -> str:
        """The `/metrics` text, engines and counters read now."""
        self.poll()
        totals: list[Gauge] = [
            (name, name.replace("_", " ").capitalize() + ".", {(): float(value)})
            for name, value in self.broker.counters.items()
        ]
        gauges = [gauge("version", "Newest weight version the broker holds.", self.broker.latest)]
        for metric, (attr, help_text) in ENGINE_GAUGES.items():
            engines = self.broker.engines.values()
            series = {labels(engine=e.url): float(getattr(e, attr)) for e in engines}
            gauges.append((metric, help_text, series))
        return self.metrics.render(gauges, totals)

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.poll_s)

    def close(self) -> None:
        self.poll()
        if self.timeline is not None:
            self.timeline.close()
