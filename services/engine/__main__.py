"""`tandem engine`: serve a Hugging Face model over SGLang's HTTP API (the reference engine)."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from services.common.auth import check_bind, token_from_env
from services.common.serving import EXIT_CODES, run_service, serve
from services.common.settings import load
from services.engine.config import EngineConfig, check

PROG = "tandem engine"
DESCRIPTION = (
    "Reference inference engine: loads a Hugging Face model (llama, mistral, qwen2, qwen3, "
    "qwen3_moe) with transformers and serves SGLang's HTTP API (/generate, health and info, "
    "pause/abort, weight updates from the weight broker, disk or torch.distributed, OpenAI "
    "/v1/*), batching concurrent requests with a KV cache. Runs on CPU or CUDA. " + EXIT_CODES
)


def main(argv: list[str]) -> int:
    config = load(EngineConfig, argv, "engine", PROG, about=DESCRIPTION)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    at = config.serve
    return run_service(
        "engine",
        lambda: start(config),
        lambda app, sock: run(app, config, sock),
        listen=(at.host, at.port),
        ready_file=at.ready_file,
    )


def start(config: EngineConfig) -> Any:
    """The engine's app with its model loaded; a bad flag, model or device is exit 2."""
    check_bind(config.serve.host, token_from_env(), "tandem engine")
    config.validate()
    if problems := check(config):
        raise ValueError(problems[0])
    from services.engine.server import create_app

    try:
        return create_app(config)
    except (OSError, RuntimeError) as exc:  # an unreadable model, a device torch does not see
        raise ValueError(str(exc)) from exc


def run(app: Any, config: EngineConfig, sock: socket.socket | None) -> None:
    at = config.serve
    serve(
        app,
        at.host,
        at.port,
        at.ready_file,
        max_request_bytes=at.max_request_bytes,
        graceful_shutdown_s=at.graceful_shutdown_s,
        on_shutdown=app.state.engine.shut_down_requests,
        sock=sock,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
