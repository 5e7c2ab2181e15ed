"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response

from services.engine.engine import Engine


def add_openai_routes(app: FastAPI, engine: Engine) -> None:
    from services.engine.server import json_response

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": engine.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "tandem", "root": engine.served_model_name,
                "max_model_len": engine.context_length}  # fmt: skip
        return json_response({"object": "list", "data": [card]})
