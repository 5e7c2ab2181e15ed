"""422 answers for request bodies that fail validation, as JSON even when the body held a number
JSON cannot carry: `1e400` parses to inf, FastAPI's own answer echoes the input, and its JSON
encoder then refused it with a 500. Non-finite numbers are answered as null."""

from __future__ import annotations

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError


def answer_invalid_bodies(app: FastAPI) -> None:
    """Install the 422 handler on `app`."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> Response:
        detail = orjson.dumps({"detail": jsonable_encoder(exc.errors())})
        return Response(detail, status_code=422, media_type="application/json")
