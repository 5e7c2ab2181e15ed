"""A stand-in engine for broker tests: real HTTP, real ZMQ fetch, no model.

It implements the two calls the broker makes (`/get_weight_version`,
`/update_weights_from_zmq`) by fetching the version through the real
`fetch_weights` and remembering the sum of every tensor it received. `--fail` makes updates
fail; `--hang-s` makes them hang that long first (to test the broker's timeouts).
"""

from __future__ import annotations

import argparse
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.common.serving import serve
from services.weight_sync.wire import secret_from_env
from services.weight_sync.zmq_transport import fetch_weights


def create_app(fail: bool, hang_s: float) -> FastAPI:
    app = FastAPI()
    app.state.version = "0"
    app.state.checksums: dict[str, float] = {}

    @app.get("/get_weight_version")
    def version() -> dict:
        return {"weight_version": app.state.version}

    @app.get("/checksums")
    def checksums() -> dict:
        return {"version": app.state.version, "sums": app.state.checksums}

    @app.post("/update_weights_from_zmq")
    def update(body: dict) -> JSONResponse:
        if hang_s:
            time.sleep(hang_s)
        if fail:
            return JSONResponse({"success": False, "message": "told to fail"}, status_code=500)
        tensors = fetch_weights(body["endpoint"], int(body["weight_version"]), secret_from_env())
        app.state.checksums = {name: float(t.double().sum()) for name, t in tensors}
        app.state.version = body["weight_version"]
        return JSONResponse({"success": True, "message": "ok"})

    @app.post("/update_weights_from_disk")
    def update_from_disk(body: dict) -> JSONResponse:
        from pathlib import Path

        from safetensors.torch import load_file

        path = Path(body["model_path"])
        if not (path / "config.json").exists():
            return JSONResponse({"success": False, "message": "no config.json"}, status_code=400)
        tensors = load_file(str(path / "model.safetensors"))
        app.state.checksums = {name: float(t.double().sum()) for name, t in tensors.items()}
        app.state.version = body["weight_version"]
        return JSONResponse({"success": True, "message": "ok"})

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--hang-s", type=float, default=0.0)
    args = parser.parse_args()
    serve(create_app(args.fail, args.hang_s), "127.0.0.1", args.port, args.ready_file)
