"""Rollout control routes: status, start, pause, resume, stop, and the live settings.

Mutating routes require `Authorization: Bearer <token>` when the router has a token
(`TANDEM_API_TOKEN`, `TANDEM_ROUTER_TOKEN` or `--api-token`); read-only routes never do.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request

from services.common.auth import WRITE
from services.rollout_router.config import RolloutPatch
from services.rollout_router.rollout.control import (
    ConfigPatchError,
    PatchRecordError,
    RolloutController,
)

router = APIRouter()


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
    pool = request.app.state.pool
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
    await control_of(request).pause()
    return {"paused": True}


@router.post("/rollout/resume", tags=["rollout"], dependencies=WRITE)
async def rollout_resume(request: Request) -> dict[str, Any]:
    """Resume a paused loop."""
    await control_of(request).resume()
    return {"paused": False}


@router.post("/rollout/stop", tags=["rollout"], dependencies=WRITE)
async def rollout_stop(request: Request) -> dict[str, Any]:
    """Stop now; groups in flight are recorded as drops (`cancelled`)."""
    await control_of(request).stop(
        "POST /rollout/start (rollout was stopped on request)", mark=True
    )
    return {"running": False}


@router.get("/rollout/config", tags=["rollout"])
async def rollout_config(request: Request) -> dict[str, Any]:
    """The rollout, sampling and data settings in use."""
    return control_of(request).config()


@router.patch("/rollout/config", tags=["rollout"], dependencies=WRITE)
async def patch_rollout_config(request: Request, changes: RolloutPatch) -> dict[str, Any]:
    """Change sampling parameters (`rollout_temperature`, `rollout_max_response_len`, ...),
    concurrency (`rollout_max_concurrency`) or the dataset (`prompt_data`, ...); validated,
    all or nothing, effective from the next request. A field the body type does not have is
    answered 422 naming it: an unknown one, or a run term (`rollout_batch_size`,
    `n_samples_per_prompt`, `max_staleness`, `num_steps_per_rollout`, `model`, `seed`), which
    the trainer relies on and which is fixed for the run (restart the run with the flag
    instead). A response length or dataset whose samples would be longer than the run's
    trainer takes (the limits it stated at its start), or a response length an admitted
    engine's context cannot hold with a prompt, is answered 422, naming what fits. Each
    accepted change is first recorded in the run's Redis (503 when it cannot be, and not
    applied): a router started on the run re-applies it, and `tandem up` copies the record to
    RUN_DIR/patches.jsonl."""
    try:
        return await control_of(request).patch(changes)
    except ConfigPatchError as exc:
        raise HTTPException(422, str(exc)) from exc
    except PatchRecordError as exc:
        raise HTTPException(503, str(exc)) from exc
