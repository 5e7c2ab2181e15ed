"""`tandem broker`: receive weight versions from the trainer and sync every engine to them."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from services.common.auth import check_bind, is_loopback, token_from_env
from services.common.config_file import parse_args
from services.common.flags import add_config_args, config_from_args
from services.common.serving import PortInUseError, add_serving_args, serve
from services.weight_broker.config import BrokerConfig

DESCRIPTION = """\
Weight broker. The trainer pushes each new weight version here over ZMQ (--intake-endpoint);
the broker then has every engine (--engine-urls) fetch it (--serve-endpoint) and reports the
version all engines serve to Redis (--redis-url) for the router's staleness gate. State at
GET /state, Prometheus metrics at GET /metrics. Frames are HMAC-checked when
TANDEM_WEIGHT_SECRET is set (same value for trainer, broker and engines).
"""


def check_weight_endpoints(config: Any) -> None:
    """Weight frames from outside loopback must be signed: refuse to bind such an endpoint
    without a secret, naming the variable."""
    from services.weight_sync.wire import SECRET_ENV, secret_from_env

    if secret_from_env() is not None:
        return
    for flag, endpoint in (
        ("--intake-endpoint", config.intake_endpoint),
        ("--serve-endpoint", config.serve_endpoint),
    ):
        host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        if endpoint.startswith("tcp://") and not is_loopback(host):
            raise ValueError(
                f"{flag} {endpoint} accepts weights from other machines, but {SECRET_ENV} is "
                f"not set: set {SECRET_ENV} (the same value for trainer, broker and engines; "
                "`tandem up` generates one), or bind 127.0.0.1"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem broker", description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind host (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8300, help="HTTP port; 0 = any free port")
    parser.add_argument("--ready-file", help="write {url, endpoints, pid} here once serving")
    add_config_args(parser, BrokerConfig)
    add_serving_args(parser, max_request_mib=1)  # its bodies are engine URLs
    return parser


def main(argv: list[str] | None = None) -> int:
    from services.weight_broker.server import create_app

    args = parse_args(build_parser(), list(sys.argv[1:] if argv is None else argv), "broker")
    logging.basicConfig(level=logging.INFO, format="[broker] %(asctime)s %(message)s")
    config = config_from_args(BrokerConfig, args)
    problem = agree_contract(config)
    if problem:
        print(f"tandem broker: {problem}", file=sys.stderr)
        return 2
    try:
        check_bind(args.host, token_from_env(), "tandem broker")
        check_weight_endpoints(config)
    except ValueError as exc:
        print(f"tandem broker: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(config)
    except Exception as exc:  # zmq bind errors name the endpoint; translate for the user
        print(
            f"tandem broker: cannot bind ZMQ sockets: {exc} "
            "(check --intake-endpoint / --serve-endpoint)",
            file=sys.stderr,
        )
        return 1
    broker = app.state.broker
    try:
        serve(
            app,
            args.host,
            args.port,
            args.ready_file,
            extra={
                "intake_endpoint": broker.intake_endpoint,
                "serve_endpoint": broker.serve_endpoint,
            },
            max_request_bytes=args.max_request_bytes,
            graceful_shutdown_s=args.graceful_shutdown_s,
        )
    except PortInUseError as exc:
        print(f"tandem broker: {exc}", file=sys.stderr)
        return 1
    return 0


def agree_contract(config: BrokerConfig) -> str:
    """State the broker's term of the run contract (how versions arrive: the trainer's
    `--weight-transport`); returns the problem, or "" when the run agrees."""
    if not config.redis_url:
        return ""
    from proto.contract import ContractMismatchError, RunContract
    from services.sample_buffer import BufferConfig, SampleBuffer

    buffer = SampleBuffer(BufferConfig(redis_url=config.redis_url, run_id=config.run_id))
    try:
        buffer.wait_ready(30.0)
        intake = "nccl" if config.transport == "nccl" else "zmq"  # disk takes zmq buckets in
        buffer.agree_contract(RunContract(weight_transport=intake), "broker")
    except (ConnectionError, ContractMismatchError) as exc:
        return str(exc)
    return ""


if __name__ == "__main__":
    sys.exit(main())
