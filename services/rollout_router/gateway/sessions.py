"""Agent sessions: an outside agent talks to the model through the router and is trained on.

The protocol (`POST /v1/chat/completions` with a session id, then `POST /sessions/{id}/reward`),
how turns merge into samples by exact prefix and the session bounds are in docs/protocols.md.

A reward that would put a group waits for room in the buffer (`--max-buffer-depth`,
backpressure.py) up to `session_put_timeout_s`, then fails with `BufferFullError` (answered 503
with Retry-After) and leaves its session open, so the agent's retry finds it: nothing is
dropped for a full buffer.

What the router holds of them, and how turns merge into samples: session_store.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from proto import DropReason, DropRecord
from proto.contract import SampleLimits
from proto.packed import PackedGroup, pack_sample
from services.common.chat_messages import MessageError, joined_text
from services.rollout_router.backpressure import BufferBound
from services.rollout_router.balancer.engine_context import reported_context
from services.rollout_router.balancer.worker import NoWorkerError
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.config import SessionConfig
from services.rollout_router.gateway.chat_input import (
    TurnError,
    check_messages,
    check_neutral,
    encode_prompt,
    message_chars,
    model_context_length,
    prompt_char_limit,
    requested_max_tokens,
    sampling_params,
    template_inputs,
    top_logprobs,
)
from services.rollout_router.gateway.session_store import SessionStore, session_samples
from services.rollout_router.gateway.tool_calls import PARSERS, Parser, leading_text
from services.rollout_router.samples import Partial, as_list
from services.sample_buffer import AsyncSampleBuffer

TRAINER_LIMITS_S = 5.0  # how often a chat turn reads the trainer's limits again
CLOSE_WRITES_S = 5.0  # the router's stop waits this long at most to record its sessions' drops

log = logging.getLogger("tandem.router.sessions")


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def openai_response(
    partial: Partial,
    model: str,
    prompt_len: int,
    token_texts: list[str] | None,
    parse: Parser | None = None,
    tops: list[list[tuple[float, str]]] | None = None,
) -> dict[str, Any]:
    """An OpenAI `chat.completion` object for one turn; with `token_texts` (the request asked
    for `logprobs`) each generated token's text and log-prob, and its `tops` (log-prob, text) as
    `top_logprobs` (`[]` each when not asked); with `parse` (the request listed
    tools) the tool calls read from its text as `tool_calls` (finish `tool_calls`), the text
    before them as the content."""
    finish = partial.finish
    message: dict[str, Any] = {"role": "assistant", "content": partial.text}
    calls = parse(partial.text)[0] if parse is not None else []
    if calls:
        message["content"] = leading_text(partial.text) or None
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "index": i,
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for i, c in enumerate(calls)
        ]
        finish = "tool_calls" if finish == "stop" else finish
    logprobs = None
    if token_texts is not None:
        if not tops or len(tops) != len(token_texts):  # (not asked, or an engine's fault)
            tops = [[] for _ in token_texts]
        logprobs = {
            "content": [
                {
                    **logprob_item(text, lp),
                    "top_logprobs": [logprob_item(t, top_lp) for top_lp, t in top],
                }
                for text, lp, top in zip(token_texts, partial.logprobs, tops, strict=True)
            ]
        }
    return {
        "id": new_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": logprobs,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": len(partial.ids),
            "total_tokens": prompt_len + len(partial.ids),
        },
    }


def logprob_item(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class AgentSessions:
    """Chat turns of agent sessions through the engines, and their rewards into the buffer."""

    def __init__(
        self,
        config: SessionConfig,
        pool: WorkerPool,
        bound: BufferBound,
        tokenizer: Any,
        stop_token_ids: list[int],
        default_group_size: int,
    ) -> None:
        self.config = config
        self.pool, self.bound, self.tokenizer = pool, bound, tokenizer
        self.buffer: AsyncSampleBuffer = bound.buffer
        self.stop_token_ids = stop_token_ids
        self.default_group_size = default_group_size
        self.store = SessionStore(config)
        self.first_messages: dict[str, str] = {}
        self._context_length: int | None = None  # 0: unknown (no clipping)
        self.parse_tool_calls = PARSERS[config.session_tool_call_parser] or (lambda _: ([], []))
        # (when read, the value): `trainer_limits`
        self._trainer_limits: tuple[float, SampleLimits | None] = (-math.inf, None)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template: dict[str, Any] | None = None,
    ) -> list[int]:
        """Exact prompt ids: the chat template (listing `tools`, with the `template` variables),
        or (a tokenizer without one) the contents joined, the messages checked as for a
        template (roles, text parts)."""
        if getattr(self.tokenizer, "chat_template", None):
            return list(encode_prompt(self.tokenizer, messages, True, tools, **(template or {})))
        if tools:
            raise TurnError("tools need the model's chat template, and its tokenizer has none")
        return list(self.tokenizer(joined_text(messages))["input_ids"])

    async def chat(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
        """One OpenAI chat turn; raises TurnError (a ValueError) on a bad request, and
        EngineRequestError (with the engine's status: its 4xx reach the agent as is)."""
        await self.expire()
        payload, messages, tools = await self.turn_payload(body, session_id)
        input_ids = payload["input_ids"]
        new = session_id not in self.store.sessions
        if new:  # (noted first: a router killed from here on leaves it to be recorded dropped)
            await self.buffer.note_open({session_id: 0})
        try:
            partial, tops = await self.generate(payload, session_id)
            reopened = not new and session_id not in self.store.sessions
            self.store.record(session_id, input_ids, partial)
        finally:
            if new and session_id not in self.store.sessions:  # (no turn of it was recorded)
                await self.note_open(None, session_id)
        if reopened:  # its reward (or expiry) closed it meanwhile: this turn opened a new one
            await self.note_open({session_id: 0})
        self.first_messages.setdefault(session_id, json.dumps(messages))
        texts = None
        if body.get("logprobs"):
            texts = [self.tokenizer.decode([t]) for t in partial.ids]
        parse = self.parse_tool_calls if tools else None
        return openai_response(
            partial, str(body.get("model", "tandem")), len(input_ids), texts, parse, tops
        )

    async def turn_payload(
        self, body: dict[str, Any], session_id: str
    ) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
        """The /generate body of a turn (its messages checked, rendered and bounded by the
        model's context and what the trainer takes), the messages and the tools."""
        messages = check_messages(body.get("messages"))
        tools, template = template_inputs(body)
        check_neutral(body)
        params = sampling_params(body, self.stop_token_ids)
        top = top_logprobs(body)
        asked = requested_max_tokens(body)
        context = await self.context_length(session_id)
        if context is not None and message_chars(messages) > prompt_char_limit(
            self.tokenizer, context
        ):
            raise TurnError(
                f"messages hold {message_chars(messages)} characters: more tokens than the "
                f"model's context of {context} can hold"
            )
        try:
            input_ids = self.render(messages, tools, template)
        except TurnError:
            raise
        except MessageError as exc:  # (one SGLang would refuse too)
            raise TurnError(str(exc)) from exc
        except Exception as exc:  # the template refused them (jinja raise_exception, types)
            raise TurnError(f"messages do not fit the model's chat template: {exc}") from exc
        if asked is None:  # the default is clipped to what the context leaves
            asked = self.config.session_max_new_tokens
            if context is not None:
                if len(input_ids) >= context:
                    raise TurnError(
                        f"the prompt ({len(input_ids)} tokens) fills the model's context "
                        f"length ({context} tokens)"
                    )
                asked = min(asked, context - len(input_ids))
        if (room := await self.trainer_room(session_id, input_ids)) is not None:
            asked = min(asked, room)  # (finish "length" where the sample would not fit)
        params["max_new_tokens"] = asked
        if tools:  # (as SGLang: a tool call's tags may be special tokens)
            params["skip_special_tokens"] = False
        payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
        if top:  # (alternatives only: the sampled tokens are the same)
            payload["top_logprobs_num"] = top
        return payload, messages, tools

    async def generate(
        self, payload: dict[str, Any], session_id: str
    ) -> tuple[Partial, list[list[tuple[float, str]]] | None]:
        """The turn's response from an engine (its worker picked by the session), and with
        `top_logprobs_num` each token's alternatives (log-prob, text)."""
        out = as_list((await self.pool.post_json("/generate", payload, session_id))[0])[0]
        partial = Partial.of(out, payload["sampling_params"]["temperature"])
        steps = out.get("meta_info", {}).get("output_top_logprobs")
        if not payload.get("top_logprobs_num") or not isinstance(steps, list):
            return partial, None
        decode = self.tokenizer.decode
        tops = [[(lp, t if t is not None else decode([i])) for lp, i, t in s] for s in steps]
        return partial, tops

    async def note_open(self, held: dict[str, int] | None = None, *gone: str) -> None:
        """List sessions as open in Redis (`held`: a session a turn reopened, as a first turn's
        is) or take sessions and groups (`group:NAME`) off the list: a failure is logged (a
        router killed then would leave them unrecorded, or record them dropped although they
        ended)."""
        try:
            await self.buffer.note_open(held, gone=gone)
        except RedisError as exc:
            log.warning("agent sessions %s not listed as they are: %r", held or gone, exc)

    async def trainer_room(self, session_id: str, input_ids: list[int]) -> int | None:
        """The most tokens a turn on `input_ids` may generate for its sample to be one the
        run's trainer takes (its stated limits; None: no trainer has stated them). TurnError
        naming the trainer's flag when the sample already fills them."""
        if (limits := await self.trainer_limits()) is None:
            return None
        budget = limits.max_tokens
        if len(input_ids) >= budget:
            raise TurnError(
                f"the prompt ({len(input_ids)} tokens) fills the {budget} tokens the run's "
                "trainer takes in a sample (its --max-tokens-per-gpu): a longer sample is "
                "dead-lettered, never trained; end the session (post its reward), or "
                "raise the trainer's --max-tokens-per-gpu"
            )
        before = self.store.response_before(session_id, input_ids)
        if before >= limits.max_response_len:
            raise TurnError(
                f"the session's sample already holds {before} response tokens (its turns "
                "and the messages between them), the most the run's trainer takes (its "
                f"--max-response-len {limits.max_response_len}): a longer sample is "
                "dead-lettered, never trained; end the session (post its reward), start "
                "the next turn on messages that do not extend this conversation, or raise "
                "the trainer's --max-response-len"
            )
        return min(budget - len(input_ids), limits.max_response_len - before)

    async def trainer_limits(self) -> SampleLimits | None:
        """The longest sample the run's trainer takes (None: no trainer has stated it), read
        from Redis at most every TRAINER_LIMITS_S."""
        read_at, limits = self._trainer_limits
        if time.monotonic() - read_at >= TRAINER_LIMITS_S:
            limits = await self.buffer.sample_limits()
            self._trainer_limits = time.monotonic(), limits
        return limits

    async def context_length(self, session_id: str) -> int | None:
        """The engines' context length (`/server_info`, else the model's config), once."""
        if self._context_length is None:
            with contextlib.suppress(NoWorkerError):  # (then the model's config says it)
                url = self.pool.pick(set(), session_id).url
                self._context_length = await reported_context(self.pool, url)
            if not self._context_length:
                self._context_length = model_context_length(self.tokenizer) or 0
        return self._context_length or None

    async def reward(
        self, session_id: str, reward: float, group: str | None, group_size: int | None
    ) -> dict[str, Any]:
        """Close the session; put its samples (or its group's, once complete). KeyError when
        the session is unknown; `BufferFullError` (the session stays open) when the buffer
        stays full for `session_put_timeout_s`, a `RedisError` (open too) when Redis refuses."""
        if session_id not in self.store.sessions:
            raise KeyError(session_id)
        size = group_size or self.default_group_size
        if not self.store.completes(group, size):  # nothing is put: no room needed
            reopen = self._reopener(session_id, group)
            pending = self._close(session_id, reward, group, size)
            assert isinstance(pending, dict) and group, "a group that is not complete is not put"
            held = {f"group:{group}": len(self.store.groups[group].samples)}
            try:
                await self.buffer.note_open(held, gone=(session_id,))
            except RedisError:  # the session stays open for the agent's retry
                reopen()
                raise
            self.store.closed_by_reward(session_id, f"reward {reward:g}, group {group}")
            return pending
        async with self.bound.slot(self.config.session_put_timeout_s) as put_group:
            if session_id not in self.store.sessions:  # expired while waiting
                raise KeyError(session_id)
            reopen = self._reopener(session_id, group)
            closed = self._close(session_id, reward, group, size)
            if isinstance(closed, PackedGroup):
                try:
                    entry = await put_group(closed)
                except RedisError:  # not put: the session stays open for the agent's retry
                    reopen()
                    raise
                self.store.closed_by_reward(session_id, f"reward {reward:g}, {closed.group_id}")
                await self.note_open(None, session_id, *([f"group:{group}"] if group else []))
                count = len(closed.samples)
                return {
                    "status": "put",
                    "group_id": closed.group_id,
                    "samples": count,
                    "entry": entry,
                }
            return closed

    def _reopener(self, session_id: str, group: str | None) -> Callable[[], None]:
        """What reopens the session and its group as they are now, its first message too: a
        reward whose writes Redis refused leaves them for the agent's retry."""
        first = self.first_messages.get(session_id, "")
        undo = self.store.undo_close(session_id, group)

        def reopen() -> None:
            undo()
            self.first_messages[session_id] = first

        return reopen

    def _close(
        self, session_id: str, reward: float, group: str | None, size: int
    ) -> PackedGroup | dict[str, Any]:
        """Close the session: the group to put (packed), or the pending answer. ValueError
        (naming the field) when a sample does not pack."""
        session = self.store.close(session_id)
        prompt = self.first_messages.pop(session_id, "")
        group_id = f"group-{group}" if group else f"session-{session_id}"
        samples = [pack_sample(s, group_id) for s in session_samples(session, reward)]
        if group:
            complete = self.store.add_to_group(group, samples, size)
            if complete is None:
                return {"status": "pending", "group": group, "samples": len(samples)}
            samples = complete
        return PackedGroup(
            group_id,
            prompt,
            "",
            samples,
            min(s.weight_version for s in samples),
            time.time(),
        )

    async def expire(self) -> None:
        for key in self.store.expire():
            self.first_messages.pop(key, None)
            await self._drop(key, DropReason.SESSION_EXPIRED)

    async def _drop(self, key: str, reason: DropReason, samples: int = 0) -> None:
        """A session (`key`: its id) or a pending group (`group:NAME`) dropped, one group."""
        record = DropRecord(source="router", reason=reason, samples=samples, group_id=key)
        await self.buffer.record_drop(record, forget=key)

    async def close(self) -> None:
        """At the router's stop: the open sessions and the groups waiting for more sessions'
        rewards are dropped as `cancelled` (they vanished from the ledger without a word)."""
        lost = [(sid, 0) for sid in self.store.sessions]
        lost += [(f"group:{g}", len(p.samples)) for g, p in self.store.groups.items()]
        self.store.sessions.clear()
        self.store.groups.clear()
        try:  # (bounded: a Redis that does not answer loses them, logged)
            async with asyncio.timeout(CLOSE_WRITES_S):
                for key, samples in lost:
                    await self._drop(key, DropReason.CANCELLED, samples)
        except (RedisError, TimeoutError) as exc:
            log.warning("agent sessions and groups not recorded as dropped: %r", exc)
