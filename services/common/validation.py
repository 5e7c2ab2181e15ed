"""4xx answers for request bodies that are not what a route takes, never a 500.

A JSON body holding a lone surrogate escape such as "\\ud800" is answered 400 before a route
sees it (`StrictJSON`): Python's JSON parser, FastAPI's, takes it, and the string it makes is
one no UTF-8 encoder writes: routes answered 500 where they echoed, forwarded or opened it.
(orjson, the router's fast paths' parser, refuses it; a body orjson takes is not looked at
again.)

A body that fails validation is answered 422, as JSON even when it held a number JSON cannot
carry: `1e400` parses to inf, FastAPI's own answer echoes the input, and its JSON encoder then
refused it with a 500. Non-finite numbers are answered as null; an input orjson cannot write
back (an integer past 64 bits) is left out of the answer, and one that is not UTF-8 (a body
without a content type) echoed with its bad bytes replaced."""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError

from services.common.body_limit import replaying

WITH_BODY = {"POST", "PUT", "PATCH"}


class StrictJSON:
    """Pure ASGI: reads a JSON body (or one without a content type, which FastAPI parses as
    JSON), answers 400 when it holds a lone surrogate, else hands it on unchanged."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = dict(scope.get("headers") or []).get(b"content-type", b"")
        if (
            scope["type"] != "http"
            or scope["method"] not in WITH_BODY
            or (kind and b"json" not in kind)
        ):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body and lone_surrogate(body):
            message = "request body is not valid JSON: a lone surrogate escape (such as \\ud800)"
            answer = orjson.dumps({"detail": message + " is no character"})
            await Response(answer, 400, media_type="application/json")(scope, receive, send)
            return
        await self.app(scope, replaying(body, receive), send)


def lone_surrogate(body: bytes) -> bool:
    """Whether `body` parses (Python's parser) to a string holding a lone surrogate. Only a
    body orjson refuses is parsed again (a number past a double, bad JSON: FastAPI's to answer)."""
    try:
        orjson.loads(body)
        return False
    except orjson.JSONDecodeError:
        pass
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):  # not JSON, or nested too deep: FastAPI answers 400
        pass
    return False


def _text(raw: bytes) -> str:
    return raw.decode(errors="replace")


def answer_invalid_bodies(app: FastAPI) -> None:
    """Install the 400 (`StrictJSON`) and the 422 handler on `app`."""
    app.add_middleware(StrictJSON)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> Response:
        # (bytes FastAPI could not parse are echoed: as text, those not UTF-8 replaced, where
        # FastAPI's encoder raised on them, a 500)
        errors = jsonable_encoder(exc.errors(), custom_encoder={bytes: _text})
        try:
            detail = orjson.dumps({"detail": errors})
        except TypeError:
            errors = [{k: v for k, v in e.items() if k != "input"} for e in errors]
            detail = json.dumps({"detail": errors}).encode()
        return Response(detail, status_code=422, media_type="application/json")
