"""Worker registry routes (sglang-router style, plus the legacy query-string API).

Mutating routes require `Authorization: Bearer <token>` when the router has a token
(`TANDEM_API_TOKEN`, `TANDEM_ROUTER_TOKEN` or `--api-token`); read-only routes never do.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel

from services.common.auth import WRITE
from services.common.urls import HttpUrl
from services.rollout_router.balancer.worker import EngineStartupError
from services.rollout_router.balancer.workers import WorkerPool

router = APIRouter()


def pool_of(request: Request) -> WorkerPool:
    return request.app.state.pool


def removed(request: Request, key: str) -> dict[str, Any]:
    """Remove the worker of id or URL `key`; 404 naming it when there is none."""
    try:
        return pool_of(request).remove(key).to_json()
    except KeyError as exc:
        raise HTTPException(404, exc.args[0]) from exc


class WorkerIn(BaseModel):
    url: HttpUrl


@router.get("/workers", tags=["workers"])
async def list_workers(request: Request) -> dict[str, Any]:
    """Every registered worker with health, load and weight version."""
    return {"workers": [w.to_json() for w in pool_of(request).workers.values()]}


@router.post("/workers", tags=["workers"], status_code=202, dependencies=WRITE)
async def add_worker(request: Request, body: WorkerIn) -> dict[str, Any]:
    """Register a worker (202). It is admitted at once when its `/model_info` answers,
    else registered unhealthy and admitted by the health checks once it answers; one whose
    context length cannot hold the rollout's responses is refused (`refused` says why)."""
    admitted, worker = await pool_of(request).add_or_pend(body.url)
    state = "admitted" if admitted else "refused" if worker.refused else "pending"
    return {**worker.to_json(), "status": state}


@router.delete("/workers/{worker_id}", tags=["workers"], dependencies=WRITE)
async def delete_worker(request: Request, worker_id: str) -> dict[str, Any]:
    """Remove a worker by id (from `GET /workers`)."""
    return removed(request, worker_id)


@router.post("/add_worker", tags=["workers"], dependencies=WRITE)
async def add_worker_legacy(request: Request, url: HttpUrl) -> dict[str, Any]:
    """Legacy, synchronous: admit the worker now, or 502 naming it and the last failure."""
    pool = pool_of(request)
    try:
        worker = await pool.add(url, request.app.state.config.workers.health_timeout_s)
    except EngineStartupError as exc:
        raise HTTPException(502, str(exc)) from exc
    return worker.to_json()


@router.post("/remove_worker", tags=["workers"], dependencies=WRITE)
async def remove_worker_legacy(request: Request, url: str) -> dict[str, Any]:
    """Legacy form of `DELETE /workers/{id}`, by URL."""
    return removed(request, url)


@router.get("/list_workers", tags=["workers"])
async def list_workers_legacy(request: Request) -> dict[str, Any]:
    """Legacy: the worker URLs."""
    return {"urls": [w.url for w in pool_of(request).workers.values()]}
