"""Streamed requests (`"stream": true`) through the router: retried until the first event, then
relayed event by event.

The rule. The router opens the request on a worker chosen by the pool's policy and waits for
the worker's first complete server-sent event (`data: ...` up to its blank line) before it
answers the client. Until then nothing has reached the client, so a worker that refuses the
connection, answers 5xx, or closes before its first event is retried on another admitted worker,
at most `--max-retries` times, as an unstreamed request is. Once the first event has been sent
the request belongs to that worker. If the worker then fails (the connection breaks, the stream
ends before `data: [DONE]`, or `--request-timeout-s` passes), the client gets the events that
were complete, then

    data: {"error": {"message": "...", "type": "worker_failed", "code": 502}}

    data: [DONE]

and the response ends at once: the shape in which SGLang ends a stream that failed (an `error`
object, then `[DONE]`), never a hang and never a silently cut stream. Events are relayed whole,
so a client never sees half an event. An answer that is not an event stream (a 4xx, or an
engine that ignored `stream`) is passed on unchanged.

Knows: SSE framing, the pool's choice of worker and its per-worker counters. Does not know what
the events contain.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
from fastapi import Response
from fastapi.responses import StreamingResponse

from services.rollout_router.balancer.worker import EngineRequestError, Worker
from services.rollout_router.balancer.workers import WorkerPool

log = logging.getLogger("tandem.router.streaming")

DONE = b"data: [DONE]"
JSON_HEADERS = {"Content-Type": "application/json"}


def error_event(message: str) -> bytes:
    """The last events of a stream whose worker failed after it had started answering."""
    error = {"message": message, "type": "worker_failed", "code": 502}
    return b"data: " + orjson.dumps({"error": error}) + b"\n\n" + DONE + b"\n\n"


async def read_events(resp: aiohttp.ClientResponse, pending: bytes) -> tuple[bytes, bytes]:
    """(complete events, the bytes after them) once at least one more event is complete;
    (b"", what was left) when the stream ends."""
    while (cut := pending.rfind(b"\n\n")) < 0:
        chunk = await resp.content.readany()
        if not chunk:
            return b"", pending
        pending += chunk
    return pending[: cut + 2], pending[cut + 2 :]


def ends_with_done(events: bytes) -> bool:
    return events.rstrip().rsplit(b"\n\n", 1)[-1].strip() == DONE


async def relay(
    worker: Worker, resp: aiohttp.ClientResponse, events: bytes, pending: bytes
) -> AsyncIterator[bytes]:
    """Yield `events`, then each further batch of complete events; a failure after the first
    event ends the stream with `error_event`. Releases the worker's slot however it ends."""
    done, failure = False, ""
    try:
        while events:
            yield events
            done = ends_with_done(events)
            events, pending = await read_events(resp, pending)
        if not done:
            failure = "the worker ended the stream before data: [DONE]"
    except (TimeoutError, aiohttp.ClientError) as exc:
        failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        worker.outstanding -= 1
        if done:
            resp.release()
        else:  # a client that went away, or a broken worker: drop the connection
            resp.close()
    if failure:
        worker.errors += 1
        worker.last_error = f"{worker.url} stream: {failure}"
        log.warning("stream from %s failed after it started: %s", worker.url, failure)
        yield error_event(f"engine {worker.url} failed mid-stream: {failure}")


async def attempt(
    pool: WorkerPool, worker: Worker, path: str, body: bytes
) -> tuple[Response | None, str]:
    """(the answer, "") or (None, why it should be retried elsewhere)."""
    assert pool.session is not None, "WorkerPool.start() was not called"
    worker.hold()
    resp: aiohttp.ClientResponse | None = None
    relayed = False  # once True, the relay owns the response and the worker's slot
    try:
        resp = await pool.session.post(worker.url + path, data=body, headers=JSON_HEADERS)
        if resp.status >= 500:
            return None, f"HTTP {resp.status} {(await resp.read())[:200]!r}"
        if resp.content_type != "text/event-stream":
            data = await resp.read()
            return Response(data, resp.status, media_type=resp.content_type), ""
        events, pending = await read_events(resp, b"")
        if not events:
            return None, "the stream ended before its first event"
        relayed = True
        return StreamingResponse(
            relay(worker, resp, events, pending), resp.status, media_type="text/event-stream"
        ), ""
    except (TimeoutError, aiohttp.ClientError) as exc:
        return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if not relayed:
            worker.outstanding -= 1
            if resp is not None:
                resp.release()


async def stream(
    pool: WorkerPool, path: str, body: bytes, session_id: str | None = None
) -> Response:
    """Forward a streamed request (see the module docstring for the retry rule). Raises
    NoWorkerError, or EngineRequestError when every attempt failed before its first event."""
    tried: set[str] = set()
    last = "no attempt made"
    for number, worker in enumerate(pool.attempts(tried, session_id)):
        answer, why = await attempt(pool, worker, path, body)
        if answer is not None:
            return answer
        last = f"{worker.url}{path}: {why}"
        worker.errors += 1
        worker.last_error = last
        log.warning("stream attempt %d failed before its first event: %s", number + 1, last)
    raise EngineRequestError(f"{path} (stream) failed after {len(tried)} engine(s); last: {last}")
