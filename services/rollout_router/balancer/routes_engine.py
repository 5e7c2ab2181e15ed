"""Engine-compatible routes: the router answers like one SGLang engine backed by many.

`/generate`, `/v1/completions` and `/v1/chat/completions` go to one worker chosen by the pool's
policy (the `X-Session-Id` header, when present, feeds session affinity) and are retried on
another on failure. A streamed request (`"stream": true`) is retried the same way until its
worker has sent the first event; a worker that fails after that ends the stream with an
`error` event (`"type": "worker_failed"`) and `data: [DONE]` (streaming.py states the rule).
`/flush_cache`, `/pause_generation`, `/continue_generation` and `/abort_request` go to every
worker (they change engine state, so they need the bearer token when one is set). Bodies are
forwarded as bytes (only `stream` is looked at); the fan-out bodies are checked against SGLang's
request classes (`proto/sglang.py`) first, so a wrong field is a 400/422 here, not N per-worker
errors.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from proto import sglang as sg
from services.common.auth import WRITE
from services.rollout_router.balancer.streaming import stream
from services.rollout_router.balancer.worker import EngineRequestError, NoWorkerError
from services.rollout_router.balancer.workers import WorkerPool

router = APIRouter()

SESSION_HEADER = "x-session-id"


def wants_stream(body: bytes) -> bool:
    if b'"stream"' not in body:
        return False
    try:
        return bool(orjson.loads(body).get("stream"))
    except (orjson.JSONDecodeError, AttributeError):
        return False


async def forward(request: Request, path: str) -> Response:
    pool: WorkerPool = request.app.state.pool
    body = await request.body()
    session_id = request.headers.get(SESSION_HEADER)
    try:
        if wants_stream(body):
            return await stream(pool, path, body, session_id)
        status, data, _worker = await pool.post(path, body, session_id)
    except NoWorkerError as exc:
        return JSONResponse({"error": "no_available_workers", "detail": str(exc)}, 503)
    except EngineRequestError as exc:
        return JSONResponse({"error": "engine_error", "detail": str(exc)}, 502)
    return Response(data, status_code=status, media_type="application/json")


@router.post("/generate", tags=["engine"], openapi_extra=sg.body_schema(sg.GenerateReqInput))
async def generate(request: Request) -> Response:
    """SGLang `/generate`, forwarded to one engine (streaming supported)."""
    return await forward(request, "/generate")


@router.post("/v1/completions", tags=["engine"], openapi_extra=sg.body_schema(sg.CompletionRequest))
async def completions(request: Request) -> Response:
    """OpenAI completions, forwarded to one engine."""
    return await forward(request, "/v1/completions")


@router.get("/health", tags=["engine"])
async def health(request: Request) -> JSONResponse:
    """200 while the router runs; `workers` counts the admitted engines. 503 with
    `{"status": "failed", "error"}` once the rollout or evaluation task has died, or its worker
    health checks stopped (nothing would evict a dead engine any more)."""
    pool: WorkerPool = request.app.state.pool
    control = getattr(request.app.state, "control", None)
    failure = (control.failure() if control is not None else "") or pool.health_task_problem()
    if failure:
        return JSONResponse({"status": "failed", "error": failure}, 503)
    return JSONResponse({"status": "ok", "workers": len(pool.admitted())})


@router.get("/get_model_info", tags=["engine"], operation_id="get_model_info")
@router.get("/model_info", tags=["engine"], include_in_schema=False)
async def model_info(request: Request) -> Response:
    """The first admitted engine's model info, with the lowest weight version of all."""
    pool: WorkerPool = request.app.state.pool
    admitted = pool.admitted()
    if not admitted:
        return JSONResponse({"error": "no_available_workers"}, 503)
    info = dict(admitted[0].model_info)
    info["weight_version"] = str(pool.min_version())
    return JSONResponse(info)


async def fan_out(request: Request, path: str, body: BaseModel | None = None) -> dict[str, Any]:
    """The checked body (only the fields the client set) to every worker."""
    raw = body.model_dump_json(exclude_unset=True).encode() if body is not None else b""
    return await request.app.state.pool.fan_out(request.method, path, raw)


@router.get("/flush_cache", tags=["engine control"], dependencies=WRITE, operation_id="flush_get")
@router.post("/flush_cache", tags=["engine control"], dependencies=WRITE, operation_id="flush")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Sent to every engine; per-URL status."""
    return await fan_out(request, "/flush_cache")


@router.post("/pause_generation", tags=["engine control"], dependencies=WRITE)
async def pause_generation(
    request: Request, body: sg.PauseGenerationReqInput | None = None
) -> dict[str, Any]:
    """Sent to every engine; per-URL status. The rollout starts no group until
    /continue_generation (its status says so)."""
    answers = await fan_out(request, "/pause_generation", body or sg.PauseGenerationReqInput())
    request.app.state.pool.paused_at = time.time()
    return answers


@router.post("/continue_generation", tags=["engine control"], dependencies=WRITE)
async def continue_generation(
    request: Request, body: sg.ContinueGenerationReqInput | None = None
) -> dict[str, Any]:
    """Sent to every engine; per-URL status."""
    answers = await fan_out(
        request, "/continue_generation", body or sg.ContinueGenerationReqInput()
    )
    request.app.state.pool.paused_at = 0.0
    return answers


@router.post("/abort_request", tags=["engine control"], dependencies=WRITE)
async def abort_request(request: Request, body: sg.AbortReq) -> dict[str, Any]:
    """Sent to every engine; per-URL status."""
    return await fan_out(request, "/abort_request", body)
