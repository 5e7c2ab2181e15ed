"""`tandem broker`: receive weight versions from the trainer and sync every engine to them."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

import zmq

from services.common.auth import check_bind, token_from_env
from services.common.serving import EXIT_CODES, run_service, serve
from services.common.settings import load
from services.weight_broker.config import BrokerConfig, check
from services.weight_sync.wire import check_weight_bind

DESCRIPTION = (
    """\
Weight broker. The trainer pushes each new weight version here over ZMQ (--intake-endpoint);
the broker then has every engine (--engine-urls) fetch it (--serve-endpoint) and reports the
version all engines serve to Redis (--redis-url) for the router's staleness gate. State at
GET /state, Prometheus metrics at GET /metrics. Frames are HMAC-checked when
TANDEM_WEIGHT_SECRET is set (same value for trainer, broker and engines).
"""
    + EXIT_CODES
)
PROG = "tandem broker"


def main(argv: list[str] | None = None) -> int:
    config = load(
        BrokerConfig, sys.argv[1:] if argv is None else argv, "broker", PROG, about=DESCRIPTION
    )
    logging.basicConfig(level=logging.INFO, format="[broker] %(asctime)s %(message)s")
    serve_at = config.serve
    return run_service(
        "broker",
        lambda: start(config),
        lambda app, sock: run(app, config, sock),
        listen=(serve_at.host, serve_at.port),
        ready_file=serve_at.ready_file,
    )


def start(config: BrokerConfig) -> Any:
    """The broker's app, its sockets bound; ValueError (exit 2) names what to change."""
    from services.weight_broker.server import create_app

    config.validate()
    if problems := check(config):
        raise ValueError(problems[0])
    check_bind(config.serve.host, token_from_env(), "tandem broker")
    check_weight_bind("--intake-endpoint", config.endpoints.intake_endpoint)
    check_weight_bind("--serve-endpoint", config.endpoints.serve_endpoint)
    try:
        app = create_app(config)
    except zmq.ZMQError as exc:
        raise ValueError(
            f"cannot bind the weight sockets: {exc} (check --intake-endpoint / --serve-endpoint)"
        ) from exc
    app.state.broker.hold_lease()  # one per run, its contract term (ValueError naming why)
    return app


def run(app: Any, config: BrokerConfig, sock: socket.socket | None) -> None:
    transport = app.state.broker.transport
    endpoints = {name: getattr(transport, name) for name in ("intake_endpoint", "serve_endpoint")}
    at = config.serve
    serve(
        app,
        at.host,
        at.port,
        at.ready_file,
        extra=endpoints,
        max_request_bytes=at.max_request_bytes,
        graceful_shutdown_s=at.graceful_shutdown_s,
        sock=sock,
    )


if __name__ == "__main__":
    sys.exit(main())
