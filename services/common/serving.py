"""Run a service: `run_service` (every service's `main`, one exit-code table) and `serve` (a
FastAPI app under uvicorn on a socket we bind ourselves).

Exit codes, the same for every `tandem` service:
  0  the service ran as asked and stopped cleanly (SIGTERM, SIGINT or SIGHUP: open requests get
     --graceful-shutdown-s, then the service stops);
  1  a run-time failure (`ServiceError`, a dependency that never answered: `ConnectionError`,
     `TimeoutError`);
  2  bad flags or configuration: argparse's own errors, `ValueError` (contract mismatches
     included), a missing file, and a port that is taken (`ListenError`: the flag is what to
     change).
The message is one line on stderr, `tandem NAME: ...`, naming the flag or file to fix. A
service that holds something whose destructor would hang (`end_without_destructors`) leaves by
`os._exit` with the same code, its output flushed.

Binding first means: `--port 0` lets the OS pick a free port with no race between choosing and
listening, and a port that is taken fails at once with a message naming it and the flag. Once the
server is accepting connections, the bound address is written to `ready_file` (JSON with `url`,
`host`, `port`, `pid`) so a launcher knows where the service is without guessing.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from starlette.responses import JSONResponse

from services.common.body_limit import BodyLimitMiddleware

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODES = (
    "Exit codes: 0 = stopped as asked (SIGTERM, SIGINT or SIGHUP: open requests get "
    "--graceful-shutdown-s); 1 = a run-time failure (a dependency that never answered); 2 = a "
    "flag, file or setting refused, or the port taken (the message names it)."
)
T = TypeVar("T")


class ListenError(ValueError):
    """--host/--port name an address this service cannot listen on: a port that is taken or
    needs root, a host that is not this machine's (exit 2: pick another)."""


class ServiceError(RuntimeError):
    """A run-time failure to report in one line (exit 1)."""


class LateConfigError(ValueError):
    """A configuration error found once the service runs (a router's dataset row, read as it
    starts): exit 2, as at start-up."""


CONFIG_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, KeyError)
RUN_ERRORS: tuple[type[Exception], ...] = (ServiceError, ConnectionError, TimeoutError)
_exit_hard: list[str] = []  # why this process must end without destructors


def end_without_destructors(why: str) -> None:
    """Have `run_service` end this process by `os._exit` once the service stops."""
    _exit_hard.append(why)


def run_service(
    name: str,
    start: Callable[[], T],
    run: Callable[[T, socket.socket | None], int | None],
    listen: tuple[str, int] | None = None,
    ready_file: str | None = None,
) -> int:
    """The exit code of a service. `listen` (host, port) is bound first, so a taken port fails
    at once, before any model load or wait, and so does a `ready_file` that cannot be written
    (it is written only once the service is up); `start()` builds the service from its flags
    (an error there is the user's to fix, unless it is a run-time one); `run(service, socket)`
    runs it until it stops. What they raise is mapped by the table in the module docstring."""
    if ready_file and (problem := ready_file_problem(ready_file)):
        return _fail(name, 2, ValueError(problem), None)
    sock = None
    try:
        sock = bind_socket(*listen) if listen else None
        service = start()
    except RUN_ERRORS as exc:
        return _fail(name, 1, exc, sock)
    except CONFIG_ERRORS as exc:
        return _fail(name, 2, exc, sock)
    try:
        code = int(run(service, sock) or 0)
    except RUN_ERRORS as exc:
        code = _fail(name, 1, exc, sock)
    except LateConfigError as exc:
        code = _fail(name, 2, exc, sock)
    except BaseException:
        if not _exit_hard:
            raise
        traceback.print_exc()
        code = 1
    if _exit_hard:
        print(f"tandem {name}: exit {code} without destructors: {_exit_hard[0]}", file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _fail(name: str, code: int, exc: Exception, sock: socket.socket | None) -> int:
    if sock is not None:
        sock.close()
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    print(f"tandem {name}: {message or repr(exc)}", file=sys.stderr, flush=True)
    return code


def bind_socket(
    host: str, port: int, flag: str = "--port", host_flag: str = "--host"
) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free one. `ListenError`
    naming `flag` or `host_flag` when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(
                f"port {port} on {host} is already in use; pick another with {flag} "
                f"(or {flag} 0 for any free port)"
            ) from exc
        if exc.errno == errno.EACCES:
            raise ListenError(
                f"port {port} needs root (a port below 1024); pick another with {flag}"
            ) from exc
        raise ListenError(  # (a host that is no address here, or no name at all)
            f"cannot listen on {host} port {port} ({exc.strerror or exc}): {host_flag} must be "
            "an address of this machine (0.0.0.0: all of them; 127.0.0.1: this machine only)"
        ) from exc
    sock.set_inheritable(True)
    return sock


def ready_file_problem(path: str) -> str:
    """Why `write_ready_file` could not write `path` ("" when it could), naming --ready-file:
    a folder that is not there was a traceback once the service was up (its model loaded)."""
    folder = Path(path).parent
    if Path(path).is_dir():
        return f"--ready-file {path}: a folder; give a file's path"
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = "cannot write there" if folder.is_dir() else "no such folder"
        why = "not a folder" if folder.exists() and not folder.is_dir() else why
        return f"--ready-file {path}: {folder}: {why}; give a file in a folder you can write"
    return ""


def write_ready_file(path: str | Path, **info: Any) -> None:
    """Atomically write the ready file (readers never see a half-written one)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    tmp.replace(path)


class StoppingReply:
    """ASGI wrapper: a request still running when --graceful-shutdown-s ran out (uvicorn cancels
    it) is answered 503 with the reason, where uvicorn's own answer was a plain-text 500."""

    def __init__(self, app: Any, server: uvicorn.Server, graceful_shutdown_s: float) -> None:
        self.app, self.server, self.graceful_shutdown_s = app, server, graceful_shutdown_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started or not self.server.should_exit:  # (not the shutdown's cancel)
                raise
            detail = (
                "the service is stopping (SIGTERM) and this request was still running after "
                f"--graceful-shutdown-s {self.graceful_shutdown_s:g}; send it again to a "
                "running service"
            )
            answer = JSONResponse({"detail": detail}, 503, headers={"connection": "close"})
            await answer(scope, receive, send)


def serve(
    app: Any,
    host: str,
    port: int,
    ready_file: str | None = None,
    extra: dict[str, Any] | None = None,
    max_request_bytes: int = 0,
    graceful_shutdown_s: float = 10.0,
    on_shutdown: Callable[[], None] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve `app` until SIGINT/SIGTERM (SIGHUP taken as SIGTERM), then return (the service
    exits 0: it stopped as asked); raise `ListenError` if the port is taken.

    `extra` entries are added to the ready file (e.g. other endpoints the service bound); a
    callable value is called once the app has started (its lifespan ran). Bodies over
    `max_request_bytes` are answered 413 (`BodyLimitMiddleware`, outermost). On SIGTERM, open
    requests get `graceful_shutdown_s` to finish; then they are cancelled and the lifespan's
    shutdown runs (a request waiting on a paused engine never holds the process up).
    `on_shutdown` runs first, when SIGTERM arrives (the engine ends its queued requests there,
    each answered with an abort finish reason instead of a dropped connection). `sock`: one
    `bind_socket` bound already (`run_service` binds before start-up)."""
    sock = sock or bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        BodyLimitMiddleware(app, max_request_bytes),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=max(1, round(graceful_shutdown_s)),
    )
    server = uvicorn.Server(config)
    config.app = StoppingReply(config.app, server, max(1, round(graceful_shutdown_s)))
    if on_shutdown is not None:
        _before_shutdown(server, on_shutdown)
    if ready_file:
        _after_startup(server, ready_file, host, bound_port, extra or {})
    before = _stop_signals(server)
    try:
        server.run(sockets=[sock])
    finally:  # (one more signal ends a stop that hangs)
        for stop, handler in before.items():
            signal.signal(stop, handler)


def _before_shutdown(server: uvicorn.Server, on_shutdown: Callable[[], None]) -> None:
    """`on_shutdown` runs when SIGTERM arrives, before uvicorn's graceful stop."""
    original_shutdown = server.shutdown

    async def shutdown(sockets: list[socket.socket] | None = None) -> None:
        on_shutdown()
        await original_shutdown(sockets=sockets)

    server.shutdown = shutdown  # type: ignore[method-assign]


def _after_startup(
    server: uvicorn.Server, ready_file: str, host: str, port: int, extra: dict[str, Any]
) -> None:
    """The ready file is written once the app has started (its lifespan ran)."""
    original_startup = server.startup
    url_host = f"[{host}]" if ":" in host else host

    async def startup(sockets: list[socket.socket] | None = None) -> None:
        await original_startup(sockets=sockets)
        if server.started:
            resolved = {k: v() if callable(v) else v for k, v in extra.items()}
            url = f"http://{url_host}:{port}"
            write_ready_file(ready_file, url=url, host=host, port=port, **resolved)

    server.startup = startup  # type: ignore[method-assign]


def _stop_signals(server: uvicorn.Server) -> dict[int, Any]:
    """SIGHUP taken as SIGTERM (a closed terminal: SIGTERM's graceful stop, where SIGHUP's
    default ended the service mid-request); the handlers installed before, to put back. uvicorn
    stops gracefully on SIGTERM and SIGINT, then raises the signal again to the handler
    installed before it: no-op ones make that stop exit 0 (the engine and the broker died of
    the SIGTERM, and a Ctrl-C ended every service with a traceback)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    signal.signal(signal.SIGHUP, lambda *_: server.handle_exit(signal.SIGTERM, None))
    return {stop: signal.signal(stop, lambda *_: None) for stop in STOP_SIGNALS}
