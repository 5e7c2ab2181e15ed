"""The engine's HTTP plumbing shared by its native routes (server.py) and its OpenAI routes
(openai_api.py): JSON answers, reading a JSON body, and aborting work whose client went away.
It knows Starlette's request and response, nothing of the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response

from services.engine.sampling import RequestError

T = TypeVar("T")


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    return json_response(
        {"error": {"message": message, "code": status}, "message": message}, status
    )


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object ({} when empty); `RequestError` (400) otherwise."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


class ClientDisconnectedError(Exception):
    """The client went away before its answer was ready; its request was aborted."""


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (as SGLang aborts a request
    whose client went away); the engine then aborts the request's sequences."""
    task = asyncio.ensure_future(work)
    gone = asyncio.Event()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone.is_set():  # answered with 499, which nobody reads, instead of a traceback
            raise ClientDisconnectedError from None
        raise
    finally:
        watcher.cancel()
