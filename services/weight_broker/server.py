"""HTTP face of the weight broker: health, state, engine registration, and `/metrics` (a
histogram of sync seconds, counts of syncs and bytes, the broker's counters, each engine's
state) with one timeline span per engine sync (`SyncObserver.record`, the broker's `on_sync`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from services.common.auth import WRITE, token_from_env
from services.common.metrics import CONTENT_TYPE, Gauge, Metrics, gauge, labels
from services.common.urls import HttpUrl
from services.common.validation import answer_invalid_bodies
from services.sample_buffer.timeline import Timeline
from services.weight_broker.broker import EngineState, WeightBroker, log
from services.weight_broker.config import BrokerConfig

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


class EngineRequest(BaseModel):
    """`POST /engines`: an engine to keep in sync (the router sends it, as it owns every
    engine's version: the version it serves, -1 if unknown, and whether it restarted)."""

    url: HttpUrl
    weight_version: int = Field(default=-1, ge=-1)
    restarted: bool = False


def create_app(config: BrokerConfig) -> FastAPI:
    broker = WeightBroker(config)
    syncs = SyncObserver(broker)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = task = asyncio.create_task(broker.run(), name="broker")
        if broker.unsigned:
            log.warning("%s", broker.unsigned)
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        broker.transport.stop()
        if broker.lease is not None and (problem := broker.lease.release()):
            log.warning("%s", problem)
        syncs.close()

    app = FastAPI(title="Tandem weight broker", lifespan=lifespan)
    answer_invalid_bodies(app)
    app.state.broker = broker
    app.state.api_token = token_from_env()

    @app.get("/health")
    async def health() -> JSONResponse:
        task = app.state.loop
        stopped = task.done() and not task.cancelled() and task.exception()
        problem = f"the broker's loop stopped: {stopped!r}; see its log" if stopped else ""
        body = {"status": "error" if problem else "ok", "version": broker.latest}
        body |= {"warning": broker.unsigned} if broker.unsigned else {}
        return JSONResponse(
            {**body, "problem": problem} if problem else body, 503 if problem else 200
        )

    @app.get("/state")
    async def state() -> dict:
        return broker.state()

    @app.post("/engines", dependencies=WRITE)
    async def add_engine(req: EngineRequest) -> dict:
        return vars(broker.add_engine(req.url, req.weight_version, req.restarted)).copy()

    @app.delete("/engines", dependencies=WRITE)
    async def remove_engine(url: str) -> dict:
        if not broker.remove_engine(url):
            raise HTTPException(404, f"no engine {url!r} registered")
        return {"removed": url}

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(syncs.render(), media_type=CONTENT_TYPE)

    return app
