"""Agent-as-client routes: OpenAI chat completions with session recording, and session rewards.

Without a session id, `/v1/chat/completions` is forwarded to an engine unchanged (nothing is
recorded). With one (`X-Session-Id` header or `session_id` in the body), the router serves the
turn itself from exact token ids and records it (see sessions.py); `stream: true` is answered
as OpenAI stream chunks of the finished turn.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from proto import sglang as sg
from services.common.auth import WRITE, require_token
from services.rollout_router.backpressure import BufferFullError
from services.rollout_router.balancer.routes_engine import SESSION_HEADER, forward
from services.rollout_router.balancer.worker import EngineRequestError, NoWorkerError
from services.rollout_router.gateway.session_store import GroupSizeError
from services.rollout_router.gateway.sessions import AgentSessions

router = APIRouter()
RETRY_AFTER_S = 5  # a reward refused for a full buffer: when to post it again


def sessions_of(request: Request) -> AgentSessions:
    sessions = request.app.state.sessions
    if sessions is None:
        raise HTTPException(409, "agent sessions need the model's tokenizer: start with --model")
    return sessions


@router.post(
    "/v1/chat/completions",
    tags=["agents"],
    openapi_extra=sg.body_schema(sg.ChatCompletionRequest),
)
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions. With a session id the turn's exact tokens are recorded."""
    body_bytes = await request.body()
    try:
        body: dict[str, Any] = orjson.loads(body_bytes)
    except orjson.JSONDecodeError as exc:
        raise HTTPException(400, f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise HTTPException(400, "the request body must be a JSON object (OpenAI chat request)")
    session_id = request.headers.get(SESSION_HEADER) or body.pop("session_id", None)
    if not session_id:
        return await forward(request, "/v1/chat/completions")
    if not isinstance(session_id, str):
        raise HTTPException(400, "session_id must be a string")
    require_token(request)  # a session's turns become training samples: the run's agents only
    stream = body.pop("stream", None)
    if not isinstance(stream, bool | None):  # (a string was taken for false: no stream)
        raise HTTPException(400, f"stream must be true or false, got {str(stream)[:50]!r}")
    options = body.get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True
    try:
        answer = await sessions_of(request).chat(body, session_id)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from exc
    except NoWorkerError as exc:
        raise HTTPException(503, str(exc)) from exc
    except RedisError as exc:  # (a new session is noted in Redis before its first turn)
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        said = f"the buffer's Redis is unavailable ({exc}): nothing was generated"
        raise HTTPException(503, f"{said}; send the turn again", headers=retry) from exc
    except EngineRequestError as exc:
        if 400 <= exc.status < 500:  # the request's fault: the engine's status and reason
            raise HTTPException(exc.status, engine_reason(exc.body) or str(exc)) from exc
        raise HTTPException(502, str(exc)) from exc
    if stream:  # the turn is generated whole (to record it exactly), then sent as chunks
        return StreamingResponse(as_chunks(answer, usage), media_type="text/event-stream")
    return JSONResponse(answer)


def engine_reason(body: bytes) -> str:
    """The message of an engine's error answer (SGLang: `{"error": {"message"}}`, `{"message"}`
    or `{"detail"}`), else its text."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace")[:1000]
    if isinstance(data, dict):
        error = data.get("error")
        for value in (
            error.get("message") if isinstance(error, dict) else error,
            data.get("message"),
            data.get("detail"),
        ):
            if value:
                return f"engine: {str(value)[:1000]}"
    return str(data)[:1000]


async def as_chunks(answer: dict[str, Any], usage: bool) -> AsyncIterator[bytes]:
    """A finished chat completion as OpenAI stream chunks: the content (with its log-probs when
    asked), the finish, with `usage` (`stream_options.include_usage`) a chunk of the usage and
    no choices, [DONE]. (The log-probs and the usage were left out.)"""
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    deltas = [(choice["message"], choice["logprobs"], None), ({}, None, choice["finish_reason"])]
    for delta, logprobs, finish in deltas:
        one = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        yield b"data: " + orjson.dumps({**base, "choices": [one]}) + b"\n\n"
    if usage:
        yield b"data: " + orjson.dumps({**base, "choices": [], "usage": answer["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


class RewardIn(BaseModel):
    """A session's reward (a finite number: the trainer cannot train on another), and the group
    it joins with how many sessions make that group. Strict: `"1"` is text, not the number 1
    (an answer posted for a score), and `true` no reward."""

    model_config = ConfigDict(strict=True)
    reward: float  # (checked finite in the route: pydantic's error would echo inf, not JSON)
    group: str | None = Field(default=None, min_length=1)
    group_size: int | None = Field(default=None, ge=1)


def group_size_problem(body: RewardIn, max_sessions: int) -> str | None:
    """Why a reward's group_size is refused: without a group (a lone session is put alone), or
    more than --max-sessions (a group's sessions, held until it completes, count as sessions:
    10**30 was taken, the group held in memory until --session-ttl-s dropped it)."""
    size = body.group_size
    if size is not None and size > 1 and body.group is None:
        return f"group_size {size} needs a group: a session without one is put on its own"
    if size is not None and size > max_sessions:
        return (
            f"group_size {size} is more than --max-sessions ({max_sessions}), the most "
            "sessions the router holds: use a smaller group_size or raise --max-sessions"
        )
    return None


# (`path`: an id with a slash, `task-3/ep-1`, opens a session by its turns: its reward was 404)
@router.post("/sessions/{session_id:path}/reward", tags=["agents"], dependencies=WRITE)
async def session_reward(request: Request, session_id: str, body: RewardIn) -> dict[str, Any]:
    """Close a session with its reward; its turns become training samples. While the buffer is
    full (`--max-buffer-depth`) the post waits up to `--session-put-timeout-s`, then is answered
    503 with Retry-After; the session stays open for the retry. A group_size other than its
    group's (the first reward's) is answered 409, the session left open."""
    if not math.isfinite(body.reward):
        raise HTTPException(422, f"reward must be a finite number, got {body.reward}")
    if problem := group_size_problem(body, sessions_of(request).config.max_sessions):
        raise HTTPException(422, problem)
    try:
        return await sessions_of(request).reward(
            session_id, body.reward, body.group, body.group_size
        )
    except KeyError as exc:
        if taken := sessions_of(request).store.rewarded.get(session_id):  # (a retried post)
            raise HTTPException(
                409,
                f"session {session_id!r} is closed: its reward was taken ({taken}); a reward is "
                "taken once (a new turn with this id starts a new session)",
            ) from exc
        raise HTTPException(404, f"no open session {session_id!r} (unknown or expired)") from exc
    except GroupSizeError as exc:  # the session stays open for a post that agrees
        raise HTTPException(409, str(exc)) from exc
    except BufferFullError as exc:  # the session stays open: the agent posts the reward again
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        raise HTTPException(503, f"{exc}; post the reward again", headers=retry) from exc
    except RedisError as exc:  # open too (a 500 before: the session and its samples lost)
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        said = f"the buffer's Redis is unavailable ({exc}): the session stays open"
        raise HTTPException(503, f"{said}; post the reward again", headers=retry) from exc
