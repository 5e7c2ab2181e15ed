"""A pure ASGI layer, outside the FastAPI app, that forwards non-streamed `POST /generate` and
`/v1/completions` straight to the worker pool, skipping FastAPI's middleware, routing, request
objects and validation.

Why: on the hot path FastAPI's per-request machinery cost about as much CPU as the forwarding
itself (measured with py-spy under `bench/router_overhead.py`). The FastAPI routes of the same
paths still exist (OpenAPI docs, in-process use of `create_app`, and streamed requests, which
this layer hands on with the body replayed). Behaviour is identical: same worker choice,
retries and error answers. `tandem router` serves `FastForwardMiddleware(create_app(config))`.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.rollout_router.balancer.worker import EngineRequestError, NoWorkerError
from services.rollout_router.balancer.workers import WorkerPool

FAST_PATHS = {"/generate", "/v1/completions"}
SESSION_HEADER_BYTES = b"x-session-id"

Scope = dict[str, Any]


class FastForwardMiddleware:
    """Outermost ASGI layer; everything it does not forward goes to the wrapped app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state  # the pool lives there once the lifespan has run

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in FAST_PATHS:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if b'"stream"' in body:  # streamed answers go through the FastAPI route
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if replayed:  # later calls wait for the client's disconnect, as usual
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await self.app(scope, replay, send)
            return
        pool: WorkerPool = self.state.pool
        session_id = None
        for name, value in scope["headers"]:
            if name == SESSION_HEADER_BYTES:
                session_id = value.decode("latin-1")
        try:
            status, data, _worker = await pool.post(scope["path"], body, session_id)
        except NoWorkerError as exc:
            status, data = 503, orjson.dumps({"error": "no_available_workers", "detail": str(exc)})
        except EngineRequestError as exc:
            status, data = 502, orjson.dumps({"error": "engine_error", "detail": str(exc)})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
