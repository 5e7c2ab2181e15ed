"""`tandem broker`: receive weight versions from the trainer and sync every engine to them."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

import zmq

from proto.contract import RunContract
from services.common.auth import check_bind, token_from_env
from services.common.config_file import parse_args
from services.common.flags import add_config_args, config_from_args
from services.common.serving import add_serving_args, run_service, serve
from services.sample_buffer import SampleBuffer
from services.weight_broker.config import BrokerConfig
from services.weight_sync.wire import check_weight_bind

DESCRIPTION = """\
Weight broker. The trainer pushes each new weight version here over ZMQ (--intake-endpoint);
the broker then has every engine (--engine-urls) fetch it (--serve-endpoint) and reports the
version all engines serve to Redis (--redis-url) for the router's staleness gate. State at
GET /state, Prometheus metrics at GET /metrics. Frames are HMAC-checked when
TANDEM_WEIGHT_SECRET is set (same value for trainer, broker and engines).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem broker", description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind host (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="HTTP port; 0 = any free port")
    parser.add_argument("--ready-file", help="write {url, endpoints, pid} here once serving")
    add_config_args(parser, BrokerConfig)
    add_serving_args(parser, max_request_mib=1)  # its bodies are engine URLs
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), list(sys.argv[1:] if argv is None else argv), "broker")
    logging.basicConfig(level=logging.INFO, format="[broker] %(asctime)s %(message)s")
    config = config_from_args(BrokerConfig, args)
    return run_service(
        "broker",
        lambda: start(config, args.host),
        lambda app, sock: run(app, args, sock),
        listen=(args.host, args.port),
        ready_file=args.ready_file,
    )


def start(config: BrokerConfig, host: str) -> Any:
    """The broker's app, its sockets bound; ValueError (exit 2) names what to change."""
    from services.weight_broker.server import create_app

    config.validate()
    agree_contract(config)
    check_bind(host, token_from_env(), "tandem broker")
    check_weight_bind("--intake-endpoint", config.intake_endpoint)
    check_weight_bind("--serve-endpoint", config.serve_endpoint)
    try:
        app = create_app(config)
    except zmq.ZMQError as exc:
        raise ValueError(
            f"cannot bind the weight sockets: {exc} (check --intake-endpoint / --serve-endpoint)"
        ) from exc
    app.state.broker.hold_lease()  # one broker per run (ValueError naming the other)
    return app


def run(app: Any, args: argparse.Namespace, sock: socket.socket | None) -> None:
    transport = app.state.broker.transport
    endpoints = {name: getattr(transport, name) for name in ("intake_endpoint", "serve_endpoint")}
    serve(
        app,
        args.host,
        args.port,
        args.ready_file,
        extra=endpoints,
        max_request_bytes=args.max_request_bytes,
        graceful_shutdown_s=args.graceful_shutdown_s,
        sock=sock,
    )


def agree_contract(config: BrokerConfig) -> None:
    """State the broker's term of the run contract (how versions arrive: the trainer's
    `--weight-transport`); `ContractMismatchError` (exit 2) names what to change."""
    if config.redis_url:
        buffer = SampleBuffer(config.buffer_config())
        buffer.wait_ready(30.0)
        intake = "nccl" if config.transport == "nccl" else "zmq"  # disk takes zmq buckets in
        buffer.agree_contract(RunContract(weight_transport=intake), "broker")


if __name__ == "__main__":
    sys.exit(main())
