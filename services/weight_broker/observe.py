"""The broker as an operator sees it: `/metrics` (a histogram of sync seconds, counts of syncs
and bytes, the broker's counters and each engine's state) and one timeline span per engine sync
(`record`, the broker's `on_sync`: it reads what the broker recorded, changes nothing).
"""

from __future__ import annotations

from services.common.metrics import Gauge, Metrics, gauge, labels
from services.sample_buffer.timeline import Timeline
from services.weight_broker.broker import EngineState, WeightBroker

ENGINE_GAUGES = {  # metric -> (EngineState attribute, help)
    "engine_version": ("version", "Weight version the engine serves (-1: unknown)."),
    "engine_in_rotation": ("in_rotation", "1 while the engine is in rotation."),
    "engine_last_sync_seconds": ("last_sync_s", "Seconds the engine's last sync took."),
    "engine_last_sync_bytes_per_second": ("last_bytes_per_s", "Bytes/s of the engine's last sync."),
    "engine_sync_failures": ("failures", "Syncs of the engine that failed."),
}


class SyncObserver:
    def __init__(self, broker: WeightBroker) -> None:
        self.broker = broker
        self.metrics = Metrics("tandem_broker_")
        self.metrics.counter("syncs", "Engine weight syncs that completed.")
        self.metrics.counter("synced_bytes", "Bytes of weights delivered to engines.")
        self.sync_seconds = self.metrics.histogram("sync_seconds", "Seconds per engine sync.")
        buffer = broker.buffer
        self.timeline = Timeline(buffer.redis, buffer.config.run_id, "broker") if buffer else None
        broker.on_sync = self.record

    def record(self, engine: EngineState) -> None:
        """An engine finished a sync (`last_sync_at`, `last_sync_s`, `last_bytes_per_s`)."""
        seconds = engine.last_sync_s
        self.metrics.inc("syncs")
        self.metrics.inc("synced_bytes", engine.last_bytes_per_s * seconds)
        self.sync_seconds.observe(seconds)
        if self.timeline is not None:
            self.timeline.add(
                f"sync v{engine.version}",
                engine.last_sync_at - seconds,
                engine.last_sync_at,
                engine.url,
                version=engine.version,
                gb_per_s=round(engine.last_bytes_per_s / 1e9, 3),
            )

    def render(self) -> str:
        """The `/metrics` text, engines and counters read now."""
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

    def close(self) -> None:
        if self.timeline is not None:
            self.timeline.close()
