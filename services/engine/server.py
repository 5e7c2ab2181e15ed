"""HTTP routes of the reference engine: SGLang's native API plus Tandem's ZMQ weight path.

Routes only parse, call one `Engine` method and shape the answer. Control and weight bodies are
the pydantic models of `proto/sglang.py` (published in the OpenAPI schema). `/generate` is the
hot path (`tandem up` sends hundreds of small requests per step): it is parsed with orjson by
`api.parse_generate`, and only its schema is published. Errors: a malformed request is 400 with a
message naming the field (as SGLang answers validation errors); overload is 503; weight-update
failures answer `{"success": false, ...}`. Mutating routes need the run's bearer token when one
is set (`services/common/auth.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from proto import sglang as sg
from services.common.auth import WRITE, token_from_env
from services.common.metrics import CONTENT_TYPE
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.openai_api import add_openai_routes
from services.engine.sampling import RequestError
from services.engine.scheduler import QueueFullError
from services.engine.web import (
    ClientDisconnectedError,
    error_response,
    json_response,
    read_json,
    until_disconnect,
)
from services.engine.weights import UpdateError

UPDATE_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"model": sg.UpdateWeightsReqOutput},
    400: {"model": sg.UpdateWeightsReqOutput},
    409: {"model": sg.UpdateWeightsReqOutput},  # a version below the one served
}


def validation_message(exc: RequestValidationError) -> str:
    """`field.path: problem; ...` for a body that does not fit its model."""
    parts = []
    for error in exc.errors()[:5]:
        loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def create_app(config: EngineConfig, engine: Engine | None = None) -> FastAPI:
    """The engine's FastAPI app; loads the model now (unless `engine` is given)."""
    engine = engine or Engine(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="Tandem reference engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.api_token = token_from_env()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_message(exc), 400)

    @app.exception_handler(RequestError)
    async def bad_request(_request: Request, exc: RequestError) -> Response:
        return error_response(str(exc), 400)

    @app.exception_handler(QueueFullError)
    async def overloaded(_request: Request, exc: QueueFullError) -> Response:
        return error_response(str(exc), 503)

    @app.exception_handler(ClientDisconnectedError)
    async def client_gone(_request: Request, _exc: ClientDisconnectedError) -> Response:
        return Response(status_code=499)

    @app.exception_handler(UpdateError)
    async def update_failed(_request: Request, exc: UpdateError) -> Response:
        return json_response({"success": False, "message": str(exc)}, exc.status)

    @app.post("/generate", openapi_extra=sg.body_schema(sg.GenerateReqInput))
    async def generate(request: Request) -> Response:
        inp = engine.parse(await read_json(request))
        if inp.stream:
            return StreamingResponse(_sse(engine, inp), media_type="text/event-stream")
        return json_response(await until_disconnect(request, engine.generate(inp)))

    _add_info_routes(app, engine)
    _add_control_routes(app, engine)
    _add_weight_routes(app, engine)
    add_openai_routes(app, engine)

    @app.get("/metrics", tags=["observability"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition of this engine."""
        return Response(engine.metrics.render(engine.scheduler), media_type=CONTENT_TYPE)

    return app


async def _sse(engine: Engine, inp: Any) -> AsyncIterator[bytes]:
    async for chunk in engine.stream(inp):
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _add_info_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not engine.scheduler.alive:  # nothing would ever answer /generate again
            return error_response("the generation thread is not running; see the log", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ok = await engine.health_generate()
        return Response(status_code=200 if ok else 503)

    @app.get("/get_model_info", operation_id="get_model_info")
    @app.get("/model_info", operation_id="model_info")
    async def model_info() -> Response:
        return json_response(engine.model_info())

    @app.get("/get_server_info", operation_id="get_server_info")
    @app.get("/server_info", operation_id="server_info")
    async def server_info() -> Response:
        return json_response(engine.server_info())

    @app.get("/get_weight_version")
    async def weight_version() -> Response:
        return json_response({"weight_version": str(engine.weight_version)})

    @app.get("/get_load")
    async def load() -> Response:
        return json_response([{"dp_rank": 0, **engine.scheduler.load()}])


def _add_control_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/flush_cache", operation_id="flush_cache_get", dependencies=WRITE)
    @app.post("/flush_cache", operation_id="flush_cache", dependencies=WRITE)
    async def flush_cache() -> Response:
        if not await engine.flush_cache():
            return Response(
                "Cache not flushed: requests are running; retry when idle.", status_code=400
            )
        return Response("Cache flushed.", status_code=200)

    @app.post("/pause_generation", dependencies=WRITE)
    async def pause_generation(body: sg.PauseGenerationReqInput | None = None) -> Response:
        await engine.pause((body or sg.PauseGenerationReqInput()).mode)
        return json_response({"success": True, "message": "Generation paused."})

    @app.post("/continue_generation", dependencies=WRITE)
    async def continue_generation(_body: sg.ContinueGenerationReqInput | None = None) -> Response:
        engine.resume()
        return json_response({"success": True, "message": "Generation continued."})

    @app.post("/release_memory_occupation", dependencies=WRITE)
    async def release_memory(_body: sg.ReleaseMemoryOccupationReqInput | None = None) -> Response:
        await engine.release_memory()
        return json_response({"success": True, "message": "Memory released; generation paused."})

    @app.post("/resume_memory_occupation", dependencies=WRITE)
    async def resume_memory(_body: sg.ResumeMemoryOccupationReqInput | None = None) -> Response:
        await engine.resume_memory()
        return json_response({"success": True, "message": "Memory resumed; generation continues."})

    @app.post("/abort_request", dependencies=WRITE)
    async def abort_request(body: sg.AbortReq) -> Response:
        if body.abort_all:
            engine.abort(None)
        elif body.rid:
            engine.abort(body.rid)
        else:
            raise RequestError("give rid (a string) or abort_all: true")
        return Response(status_code=200)


def _add_weight_routes(app: FastAPI, engine: Engine) -> None:
    def ok(version: int, what: str) -> Response:
        return json_response({"success": True, "message": what, "weight_version": str(version)})

    @app.post("/update_weights_from_zmq", dependencies=WRITE, responses=UPDATE_ANSWERS)
    async def update_from_zmq(body: sg.UpdateWeightsFromZmqReqInput) -> Response:
        new = await engine.weights.from_zmq(
            body.endpoint, body.weight_version, body.timeout_s, body.abort_all_requests
        )
        return ok(new, f"Updated weights to version {new} from {body.endpoint}.")

    @app.post("/update_weights_from_disk", dependencies=WRITE, responses=UPDATE_ANSWERS)
    async def update_from_disk(body: sg.UpdateWeightFromDiskReqInput) -> Response:
        new = await engine.weights.from_disk(
            body.model_path, body.weight_version, body.abort_all_requests
        )
        return ok(new, f"Loaded weights from {body.model_path}.")

    @app.post("/init_weights_update_group", dependencies=WRITE, responses=UPDATE_ANSWERS)
    async def init_group(body: sg.InitWeightsUpdateGroupReqInput) -> Response:
        await engine.weights.init_group(body)
        return json_response({"success": True, "message": "Joined the weight update group."})

    @app.post("/destroy_weights_update_group", dependencies=WRITE, responses=UPDATE_ANSWERS)
    async def destroy_group(_body: sg.DestroyWeightsUpdateGroupReqInput | None = None) -> Response:
        await engine.weights.destroy_group()
        return json_response({"success": True, "message": "Left the weight update group."})

    @app.post("/update_weight_version", dependencies=WRITE, responses=UPDATE_ANSWERS)
    async def update_weight_version(body: sg.UpdateWeightVersionReqInput) -> Response:
        if body.abort_all_requests:
            engine.abort(None)
        engine.scheduler.weight_version = body.new_version
        return ok(engine.weight_version, "Weight version updated.")

    @app.get("/get_weights_by_name", operation_id="get_weights_by_name_get")
    @app.post("/get_weights_by_name", operation_id="get_weights_by_name")
    async def get_weights_by_name(body: sg.GetWeightsByNameReqInput) -> Response:
        return json_response(engine.weights_by_name(body.name, body.truncate_size))

    @app.post("/update_weights_from_distributed", dependencies=WRITE, responses=UPDATE_ANSWERS)
    async def update_from_distributed(body: sg.UpdateWeightsFromDistributedReqInput) -> Response:
        # Without names: a layout sent before under this layout_id (see engine/weights.py).
        if body.layout_id is None or body.names is not None:
            for name in ("names", "dtypes", "shapes"):
                if getattr(body, name) is None:
                    raise RequestError(f"{name} is required (unless a known layout_id is given)")
        if body.bucket_sizes is not None and any(size < 1 for size in body.bucket_sizes):
            raise RequestError("bucket_sizes must be positive integers summing to len(names)")
        new = await engine.weights.from_distributed(body)
        return ok(new, "Updated weights from the distributed group.")
