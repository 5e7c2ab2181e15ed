"""HTTP face of the weight broker: health, state, Prometheus metrics, engine registration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from services.common.auth import WRITE, token_from_env
from services.common.metrics import CONTENT_TYPE
from services.common.urls import HttpUrl
from services.weight_broker.broker import WeightBroker
from services.weight_broker.config import BrokerConfig
from services.weight_broker.observe import SyncObserver


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
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        broker.transport.stop()
        syncs.close()

    app = FastAPI(title="Tandem weight broker", lifespan=lifespan)
    app.state.broker = broker
    app.state.api_token = token_from_env()

    @app.get("/health")
    async def health() -> JSONResponse:
        task = app.state.loop
        stopped = task.done() and not task.cancelled() and task.exception()
        problem = f"the broker's loop stopped: {stopped!r}; see its log" if stopped else ""
        body = {"status": "error" if problem else "ok", "version": broker.latest}
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
