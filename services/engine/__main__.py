"""`tandem engine`: serve a Hugging Face model over SGLang's HTTP API (the reference engine)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from services.common.auth import check_bind, token_from_env
from services.common.config_file import parse_args
from services.common.flags import add_config_args, config_from_args
from services.common.serving import add_serving_args, run_service, serve
from services.engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem engine",
        description=(
            "Reference inference engine: loads a Hugging Face model (llama, mistral, qwen2, "
            "qwen3, qwen3_moe) with "
            "transformers and serves SGLang's HTTP API (/generate, health and info, pause/abort, "
            "weight updates from the weight broker, disk or torch.distributed, OpenAI /v1/*), "
            "batching concurrent requests with a KV cache. Runs on CPU or CUDA."
        ),
    )
    add_config_args(parser, EngineConfig)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (0 = any free)")
    parser.add_argument(
        "--ready-file", default=None, help="write {url,host,port,pid} here once listening"
    )
    # weight-update bodies list every tensor name, dtype and shape: thousands of entries
    add_serving_args(parser, max_request_mib=64)
    return parser


def main(argv: list[str]) -> int:
    ns = parse_args(build_parser(), argv, "engine")
    config = config_from_args(EngineConfig, ns)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    return run_service(
        "engine",
        lambda: start(config, ns.host),
        lambda app, sock: run(app, ns, sock),
        listen=(ns.host, ns.port),
        ready_file=ns.ready_file,
    )


def start(config: EngineConfig, host: str) -> Any:
    """The engine's app with its model loaded; a bad flag, model or device is exit 2."""
    check_bind(host, token_from_env(), "tandem engine")
    config.validate()
    from services.engine.server import create_app

    try:
        return create_app(config)
    except (OSError, RuntimeError) as exc:  # an unreadable model, a device torch does not see
        raise ValueError(str(exc)) from exc


def run(app: Any, ns: argparse.Namespace, sock: socket.socket | None) -> None:
    serve(
        app,
        ns.host,
        ns.port,
        ns.ready_file,
        max_request_bytes=ns.max_request_bytes,
        graceful_shutdown_s=ns.graceful_shutdown_s,
        on_shutdown=app.state.engine.shut_down_requests,
        sock=sock,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
