"""`tandem router`: command-line entry of the rollout router."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from typing import Any

from services.common.auth import check_bind, token_from_env
from services.common.serving import (
    CONFIG_ERRORS,
    EXIT_CODES,
    LateConfigError,
    ServiceError,
    run_service,
    serve,
)
from services.common.settings import load
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.config import RouterConfig, WorkerPoolConfig, depth_bound
from services.rollout_router.config_checks import check_buffer_depth
from services.sample_buffer import SampleBuffer
from services.sample_buffer.membership import Membership

DESCRIPTION = (
    """\
Rollout router. Fronts SGLang-compatible engines (balancing, health checks, retries; the router
answers /generate and /v1/* like one engine), and runs the rollout loop: prompts -> engines ->
samples -> rewards -> Redis stream, never more than --max-staleness weight versions ahead of the
trainer. Control API and OpenAPI docs at /docs. """
    + EXIT_CODES
)
PROG = "tandem router"


async def wait_for_engines(config: WorkerPoolConfig) -> None:
    pool = WorkerPool(config)
    await pool.start()
    try:
        # (only waits: the app's own pool admits them, and says so)
        await pool.add_all(config.engine_urls, config.engine_wait_timeout_s, admit=False)
    finally:
        await pool.close()


def eval_task(app: Any) -> str:
    """What the held-out accuracy scores (for the ready file: `tandem up` prints it)."""
    from services.rollout_router.rollout.evaluation import describe

    control = app.state.control
    return describe(control.loop) if control is not None else "none (no --model)"


def longest_prompt(app: Any) -> int | None:
    """The task's longest prompt in tokens (for the ready file: `tandem up` checks that the
    longest samples fit the trainer); None for environment episodes (their prompts grow)."""
    control = app.state.control
    if control is None or control.loop.episodes is not None:
        return None
    return control.loop.task.longest_prompt


def main(argv: list[str]) -> int:
    config = load(RouterConfig, argv, "router", PROG, about=DESCRIPTION)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    config.api_token = config.api_token or token_from_env("TANDEM_ROUTER_TOKEN")
    at = config.serve
    return run_service(
        "router",
        lambda: start(config),
        lambda app, sock: run(app, sock, config),
        listen=(at.host, at.port),
        ready_file=at.ready_file,
    )


def start(config: RouterConfig) -> Any:
    """The router's app (`create_app` validates and checks its config), once Redis and every
    engine answer and the run contract agrees."""
    check_bind(config.serve.host, config.api_token, "tandem router")
    # The router needs no torch; keep any library that spins up thread pools to one thread,
    # since several services share the CPU.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from services.rollout_router.app import create_app

    app = create_app(config)
    # Waiting here, before serving, turns a missing engine or Redis (or a run contract that
    # contradicts the trainer's) into one clear line and no ready file; the lifespan then
    # finds them answering at once.
    buffer = SampleBuffer(config.buffer_config())
    buffer.wait_ready(30.0)
    run = Membership(buffer, "router", print).agree(config.contract())  # (no lease yet)
    # The trainer's batch (with --no-rollout the router states none of its own): a ValueError
    # (exit 2) when --max-buffer-depth cannot hold one rollout batch.
    batch = run.rollout_batch_size or 0
    check_buffer_depth(depth_bound(config.rollout.max_buffer_depth, batch), batch)
    asyncio.run(wait_for_engines(config.workers))
    return app


def run(app: Any, sock: socket.socket | None, config: RouterConfig) -> None:
    from services.rollout_router.balancer.fastpath import FastForwardMiddleware

    at = config.serve
    try:
        serve(
            FastForwardMiddleware(app),
            at.host,
            at.port,
            at.ready_file,
            extra={
                "eval_task": lambda: eval_task(app),
                "task_notes": lambda: (
                    list(app.state.control.loop.task.notes) if app.state.control is not None else []
                ),
                "rollout_max_response_len": lambda: config.sampling.rollout_max_response_len,
                "longest_prompt": lambda: longest_prompt(app),
                "context_len": lambda: (
                    app.state.control.loop.gen.context_len if app.state.control else None
                ),
            },
            max_request_bytes=at.max_request_bytes,
            graceful_shutdown_s=at.graceful_shutdown_s,
            sock=sock,
        )
    except SystemExit as exc:  # uvicorn exits 3 when the lifespan fails
        raise startup_failure(app.state.startup_error) from exc
    if app.state.startup_error:
        raise startup_failure(app.state.startup_error)


def startup_failure(error: Exception | None) -> Exception:
    """The lifespan's failure as the exit-code table has it: a bad dataset row or any other
    configuration error is exit 2, the rest 1."""
    kind = LateConfigError if isinstance(error, CONFIG_ERRORS) else ServiceError
    return kind(f"start-up failed: {error}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
