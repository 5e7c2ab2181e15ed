"""Control routes: the worker registry and the rollout control API.

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
from services.rollout_router.rollout.control import (
    ConfigPatchError,
    ContractTermError,
    RolloutController,
)

router = APIRouter()


def pool_of(request: Request) -> WorkerPool:
    return request.app.state.pool


class WorkerIn(BaseModel):
    url: HttpUrl


# --- workers (sglang-router style, plus the legacy query-string API) ------------------------


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
    try:
        return pool_of(request).remove(worker_id).to_json()
    except KeyError as exc:
        raise HTTPException(404, exc.args[0]) from exc


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
    try:
        return pool_of(request).remove(url).to_json()
    except KeyError as exc:
        raise HTTPException(404, exc.args[0]) from exc


@router.get("/list_workers", tags=["workers"])
async def list_workers_legacy(request: Request) -> dict[str, Any]:
    """Legacy: the worker URLs."""
    return {"urls": [w.url for w in pool_of(request).workers.values()]}


# --- rollout control -----------------------------------------------------------------------


def control_of(request: Request) -> RolloutController:
    control = request.app.state.control
    if control is None:
        raise HTTPException(409, "this router has no rollout loop (start it with --model)")
    return control


@router.get("/rollout/status", tags=["rollout"])
async def rollout_status(request: Request) -> dict[str, Any]:
    """State, what the loop waits for (`waiting_for`, a sentence), batch index, versions,
    in-flight requests and groups, samples/s, buffer depth, drops (groups by reason) and the
    run's `ledger` (where every generated group went, and whether that balances); agent
    sessions open and groups of sessions waiting for the rest of their group."""
    pool = pool_of(request)
    base: dict[str, Any] = {
        "workers": len(pool.admitted()),
        "retries": pool.retries,
        "engines_min_version": pool.min_version(),
    }
    if (sessions := request.app.state.sessions) is not None:
        base.update(
            sessions_open=len(sessions.store.sessions),
            session_groups_pending=len(sessions.store.groups),
        )
    control = request.app.state.control
    if control is None:
        return {**base, "state": "disabled"}
    return {**base, **await control.status()}


@router.post("/rollout/start", tags=["rollout"], dependencies=WRITE)
async def rollout_start(request: Request) -> dict[str, Any]:
    """Start the rollout loop (no-op when running); continues with the next prompt."""
    control_of(request).start()
    return {"running": True}


@router.post("/rollout/pause", tags=["rollout"], dependencies=WRITE)
async def rollout_pause(request: Request) -> dict[str, Any]:
    """Start no more groups; those in flight finish and are put."""
    control_of(request).pause()
    return {"paused": True}


@router.post("/rollout/resume", tags=["rollout"], dependencies=WRITE)
async def rollout_resume(request: Request) -> dict[str, Any]:
    """Resume a paused loop."""
    control_of(request).resume()
    return {"paused": False}


@router.post("/rollout/stop", tags=["rollout"], dependencies=WRITE)
async def rollout_stop(request: Request) -> dict[str, Any]:
    """Stop now; groups in flight are recorded as drops (`cancelled`)."""
    await control_of(request).stop("POST /rollout/start (rollout was stopped on request)")
    return {"running": False}


@router.get("/rollout/config", tags=["rollout"])
async def rollout_config(request: Request) -> dict[str, Any]:
    """The rollout, sampling and data settings in use."""
    return control_of(request).config()


@router.patch("/rollout/config", tags=["rollout"], dependencies=WRITE)
async def patch_rollout_config(request: Request, changes: dict[str, Any]) -> dict[str, Any]:
    """Change sampling parameters (`rollout_temperature`, `rollout_max_response_len`, ...),
    concurrency (`rollout_max_concurrency`) or the dataset (`prompt_data`, ...); validated,
    all or nothing, effective from the next request. The run-contract terms
    (`rollout_batch_size`, `n_samples_per_prompt`, `max_staleness`, `num_steps_per_rollout`)
    are shared with the trainer and fixed for the run: a new value is answered 409 (restart
    the run with the flag instead). A response length or dataset whose samples would be longer
    than the run's trainer takes (the limits it stated at its start), or a response length
    an admitted engine's context cannot hold with a prompt, is answered 422, naming what
    fits."""
    try:
        return await control_of(request).patch(changes)
    except ContractTermError as exc:
        raise HTTPException(409, str(exc)) from exc
    except ConfigPatchError as exc:
        raise HTTPException(422, str(exc)) from exc
