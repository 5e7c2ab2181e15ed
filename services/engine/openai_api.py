"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request is translated to a native `/generate` request (same validation, same scheduler)
and the answer back to OpenAI's shape, with SGLang's additions: `matched_stop` on each choice,
SGLang sampling extras (`top_k`, `min_p`, `stop_token_ids`, `ignore_eos`, `no_stop_trim`,
`skip_special_tokens`, `min_tokens`), `return_token_ids` / `return_prompt_token_ids` and, so a
trainer can get the exact token ids and logprobs, `return_meta_info` (the native `meta_info`
on each choice). Chat prompts use the tokenizer's chat template.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from proto import sglang as sg
from services.common.chat_messages import MessageError, template_messages
from services.engine.api import UNSUPPORTED_FIELDS
from services.engine.engine import Engine
from services.engine.sampling import RequestError
from services.engine.web import json_response, read_json, until_disconnect

# OpenAI/SGLang request field -> native sampling parameter
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "n": "n",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
}


def _sampling(body: dict, max_tokens: Any) -> dict[str, Any]:
    params = {native: body[name] for name, native in _SAMPLING_FIELDS.items() if name in body}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params


def _top_n(body: dict, chat: bool) -> tuple[bool, int]:
    """(return_logprob, top_logprobs_num) from OpenAI's two different logprob conventions."""
    if chat:
        wanted = bool(body.get("logprobs"))
        top = body.get("top_logprobs") or 0
    else:
        value = body.get("logprobs")
        wanted, top = value is not None and value is not False, value or 0
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise RequestError("top_logprobs / logprobs must be a non-negative integer")
    return wanted or bool(body.get("return_meta_info")), top


def _unsupported(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of `body` that SGLang's OpenAI requests take and the reference engine does
    not (`lora_path`, `return_hidden_states`, ...): passed on, `/generate` refuses them (they
    were dropped: a request for a LoRA adapter was answered by the base model)."""
    return {name: body[name] for name in UNSUPPORTED_FIELDS if name in body}


def completion_request(body: Any, engine: Engine) -> dict[str, Any]:
    """The native `/generate` body for a `/v1/completions` body."""
    if not isinstance(body, dict) or "prompt" not in body:
        raise RequestError("prompt is required")
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise RequestError("echo, suffix and best_of are not supported by the reference engine")
    prompt = body["prompt"]
    key = (
        "text"
        if isinstance(prompt, str)
        or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str))
        else "input_ids"
    )
    return _native(body, key, prompt, body.get("max_tokens", 16), chat=False)


def chat_request(body: Any, engine: Engine) -> dict[str, Any]:
    """The native `/generate` body for a `/v1/chat/completions` body."""
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("messages"), list)
        or not body["messages"]
    ):
        raise RequestError("messages must be a non-empty list")
    tokenizer = engine.runner.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("the model's tokenizer has no chat template; use /v1/completions")
    try:  # (the messages as SGLang hands them to the template)
        messages = template_messages(tokenizer, body["messages"])
    except MessageError as exc:
        raise RequestError(str(exc)) from exc
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            **(body.get("chat_template_kwargs") or {}),
        )
    except Exception as exc:  # template errors are the caller's messages, not our bug
        raise RequestError(f"messages could not be rendered by the chat template: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return _native(body, "input_ids", list(ids), max_tokens, chat=True)


def _native(body: dict, key: str, prompt: Any, max_tokens: Any, chat: bool) -> dict[str, Any]:
    """The native `/generate` body of an OpenAI one whose prompt is `prompt` (as `key`)."""
    return_logprob, top = _top_n(body, chat)
    return {
        **_unsupported(body),
        key: prompt,
        "sampling_params": _sampling(body, max_tokens),
        "return_logprob": return_logprob,
        "top_logprobs_num": top,
        "stream": body.get("stream", False),
        "return_text_in_logprobs": True,
        "rid": body.get("rid"),
        "return_prompt_token_ids": bool(
            body.get("return_token_ids") or body.get("return_prompt_token_ids")
        ),
    }


def _completion_logprobs(meta: dict) -> dict[str, Any]:
    entries = meta.get("output_token_logprobs", [])
    tops = meta.get("output_top_logprobs")
    tokens = [e[2] for e in entries]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token or "")
    return {
        "tokens": tokens,
        "token_logprobs": [e[0] for e in entries],
        "text_offset": offsets,
        "top_logprobs": [{t[2]: t[0] for t in step} for step in tops] if tops else None,
    }


def _chat_logprobs(meta: dict) -> dict[str, Any]:
    def item(entry: list) -> dict[str, Any]:
        text = entry[2] or ""
        return {"token": text, "logprob": entry[0], "bytes": list(text.encode())}

    tops = meta.get("output_top_logprobs") or [[] for _ in meta.get("output_token_logprobs", [])]
    return {
        "content": [
            {**item(entry), "top_logprobs": [item(t) for t in top]}
            for entry, top in zip(meta.get("output_token_logprobs", []), tops, strict=True)
        ]
    }


def _choice(index: int, result: dict, body: dict, chat: bool) -> dict[str, Any]:
    meta = result["meta_info"]
    reason = meta["finish_reason"]
    wants_logprobs = body.get("logprobs") if chat else body.get("logprobs") is not None
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": result["text"]}
        choice["logprobs"] = _chat_logprobs(meta) if wants_logprobs else None
    else:
        choice["text"] = result["text"]
        choice["logprobs"] = _completion_logprobs(meta) if wants_logprobs else None
    choice["finish_reason"] = reason["type"] if reason else None
    choice["matched_stop"] = reason.get("matched") if reason else None
    if body.get("return_token_ids"):
        choice["response_token_ids" if chat else "token_ids"] = result["output_ids"]
    if body.get("return_token_ids") or body.get("return_prompt_token_ids"):
        choice["prompt_token_ids"] = result.get("prompt_token_ids")
    if body.get("return_meta_info"):
        choice["meta_info"] = meta
    return choice


def openai_response(results: list[dict], body: dict, model: str, chat: bool) -> dict[str, Any]:
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results) // max(
        body.get("n", 1) or 1, 1
    )
    completion_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "id": results[0]["meta_info"]["id"],
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(i, r, body, chat) for i, r in enumerate(results)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _stream(engine: Engine, native: Any, model: str, chat: bool) -> AsyncIterator[bytes]:
    """OpenAI stream chunks (text deltas) from the engine's cumulative snapshots."""
    sent: dict[int, int] = {}
    created = int(time.time())
    async for snap in engine.stream(native):
        index = snap.get("index", 0)
        delta = snap["text"][sent.get(index, 0) :]
        sent[index] = len(snap["text"])
        reason = snap["meta_info"]["finish_reason"]
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": None,
            "finish_reason": reason["type"] if reason else None,
        }
        if chat:
            choice["delta"] = {"role": "assistant", "content": delta}
        else:
            choice["text"] = delta
        chunk = {
            "id": snap["meta_info"]["id"],
            "created": created,
            "model": model,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [choice],
        }
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


def add_openai_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tandem",
            "root": engine.served_model_name,
            "max_model_len": engine.context_length,
        }
        return json_response({"object": "list", "data": [card]})

    async def serve(request: Request, chat: bool) -> Response:
        body = await read_json(request)
        native = engine.parse((chat_request if chat else completion_request)(body, engine))
        model = body.get("model") or engine.served_model_name
        if native.stream:
            return StreamingResponse(
                _stream(engine, native, model, chat), media_type="text/event-stream"
            )
        results = await until_disconnect(request, engine.generate(native))
        results = results if isinstance(results, list) else [results]
        return json_response(openai_response(results, body, model, chat))

    @app.post("/v1/completions", openapi_extra=sg.body_schema(sg.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=sg.body_schema(sg.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)
