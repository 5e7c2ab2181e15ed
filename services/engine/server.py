"""HTTP routes of the reference engine: SGLang's native API plus Tandem's ZMQ weight path.

Routes only parse, call one `Engine` method and shape the answer. Bodies are read and written
with orjson directly (no pydantic models) because `/generate` is the hot path: `tandem up`
sends hundreds of small requests per step. Errors: a malformed request is 400 with a message
naming the field; overload is 503; weight-update failures answer `{"success": false, ...}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.openai_api import add_openai_routes
from services.engine.sampling import RequestError
from services.engine.scheduler import QueueFullError
from services.engine.weights import UpdateError

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


def field(
    body: dict[str, Any], name: str, check: Callable[[Any], bool], what: str, required: bool = True
) -> Any:
    """`body[name]` if it passes `check`; `RequestError` naming the field otherwise."""
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required ({what})")
        return None
    if not check(value):
        raise RequestError(f"{name} must be {what}, got {str(value)[:100]!r}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_version(v: Any) -> bool:
    return isinstance(v, str) or _is_int(v)


def _is_list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


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

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        inp = engine.parse(await read_json(request))
        if inp.stream:
            return StreamingResponse(_sse(engine, inp), media_type="text/event-stream")
        return json_response(await until_disconnect(request, engine.generate(inp)))

    _add_info_routes(app, engine)
    _add_control_routes(app, engine)
    _add_weight_routes(app, engine)
    add_openai_routes(app, engine)
    return app


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


async def _sse(engine: Engine, inp: Any) -> AsyncIterator[bytes]:
    async for chunk in engine.stream(inp):
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _add_info_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ok = await engine.health_generate()
        return Response(status_code=200 if ok else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> Response:
        return json_response(engine.model_info())

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        return json_response(engine.server_info())

    @app.get("/get_weight_version")
    async def weight_version() -> Response:
        return json_response({"weight_version": engine.weight_version})

    @app.get("/get_load")
    async def load() -> Response:
        return json_response([{"dp_rank": 0, **engine.scheduler.load()}])


def _add_control_routes(app: FastAPI, engine: Engine) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not await engine.flush_cache():
            return Response(
                "Cache not flushed: requests are running; retry when idle.", status_code=400
            )
        return Response("Cache flushed.", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await read_json(request)
        await engine.pause(str(body.get("mode") or "abort"))
        return json_response({"success": True, "message": "Generation paused."})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        engine.resume()
        return json_response({"success": True, "message": "Generation continued."})

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> Response:
        body = await read_json(request)
        field(body, "tags", _is_list_of(_is_str), "a list of tags (weights, kv_cache)", False)
        await engine.release_memory()
        return json_response({"success": True, "message": "Memory released; generation paused."})

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> Response:
        body = await read_json(request)
        field(body, "tags", _is_list_of(_is_str), "a list of tags (weights, kv_cache)", False)
        await engine.resume_memory()
        return json_response({"success": True, "message": "Memory resumed; generation continues."})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        if body.get("abort_all"):
            engine.abort(None)
        elif isinstance(body.get("rid"), str) and body["rid"]:
            engine.abort(body["rid"])
        else:
            raise RequestError("give rid (a string) or abort_all: true")
        return Response(status_code=200)


def _add_weight_routes(app: FastAPI, engine: Engine) -> None:
    def ok(version: str, what: str) -> Response:
        return json_response({"success": True, "message": what, "weight_version": version})

    @app.post("/update_weights_from_zmq")
    async def update_from_zmq(request: Request) -> Response:
        body = await read_json(request)
        endpoint = field(body, "endpoint", _is_str, "a ZMQ address such as tcp://host:port")
        version = field(body, "weight_version", _is_version, "a version string")
        timeout_s = field(
            body, "timeout_s", lambda v: _is_int(v) or isinstance(v, float), "seconds", False
        )
        abort_all = bool(body.get("abort_all_requests"))
        new = await engine.weights.from_zmq(endpoint, str(version), timeout_s, abort_all)
        return ok(new, f"Updated weights to version {new} from {endpoint}.")

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> Response:
        body = await read_json(request)
        field(body, "model_path", _is_str, "a Hugging Face model directory")
        version = field(body, "weight_version", _is_version, "a version string", False)
        new = await engine.weights.from_disk(
            body["model_path"],
            None if version is None else str(version),
            bool(body.get("abort_all_requests")),
        )
        return ok(new, f"Loaded weights from {body['model_path']}.")

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> Response:
        body = await read_json(request)
        field(body, "master_address", _is_str, "a host name or address")
        for name in ("master_port", "world_size"):
            field(body, name, _is_int, "an integer")
        field(body, "rank_offset", _is_int, "an integer", False)
        field(body, "group_name", _is_str, "a string", False)
        await engine.weights.init_group(body)
        return json_response({"success": True, "message": "Joined the weight update group."})

    @app.post("/destroy_weights_update_group")
    async def destroy_group() -> Response:
        await engine.weights.destroy_group()
        return json_response({"success": True, "message": "Left the weight update group."})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await read_json(request)
        field(body, "new_version", _is_version, "a version string")
        if body.get("abort_all_requests", True):
            engine.abort(None)
        engine.scheduler.weight_version = str(body["new_version"])
        return ok(engine.weight_version, "Weight version updated.")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Response:
        body = await read_json(request)
        return json_response(
            engine.weights_by_name(body.get("name"), body.get("truncate_size", 100))
        )

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> Response:
        body = await read_json(request)
        field(body, "layout_id", _is_str, "a string", False)
        # Without names: a layout sent before under this layout_id (see engine/weights.py).
        listed = body.get("layout_id") is None or body.get("names") is not None
        field(body, "names", _is_list_of(_is_str), "a list of parameter names", listed)
        field(body, "dtypes", _is_list_of(_is_str), "a list of dtype names", listed)
        field(
            body,
            "shapes",
            _is_list_of(_is_list_of(_is_int)),
            "a list of shapes (lists of ints)",
            listed,
        )
        field(body, "weight_version", _is_version, "a version string", False)
        field(body, "group_name", _is_str, "a string", False)
        field(body, "load_format", _is_str, '"flattened_bucket" or null', False)
        field(
            body,
            "bucket_sizes",
            _is_list_of(lambda v: _is_int(v) and v > 0),
            "a list of tensor counts (positive integers) summing to len(names)",
            False,
        )
        if body.get("weight_version") is not None:
            body["weight_version"] = str(body["weight_version"])
        new = await engine.weights.from_distributed(body)
        return ok(new, "Updated weights from the distributed group.")
