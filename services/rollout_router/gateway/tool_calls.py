"""Tool calls in a model turn, read from the turn's text for an environment's `/step`.

Knows: the text formats in which models write tool calls. Does not know: tokens (parsing reads
the text the engine decoded; the turn's token ids are kept exactly as generated), HTTP, or what
a tool does.

`hermes` (Hermes, Qwen2.5 and Qwen3 chat templates): each call is
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>`, any number per turn, with any text
around them. `arguments` may also be a JSON string holding an object (some models write it
encoded) or absent (no arguments). A call that cannot be read (not JSON, no `name`, arguments
not an object, no closing tag because the turn ended first) becomes an error string naming the
call and the reason; the other calls of the turn are still returned.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

ToolCall = dict[str, Any]  # {"name": str, "arguments": dict}
Parser = Callable[[str], tuple[list[ToolCall], list[str]]]


def parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """(calls, errors) of the `<tool_call>` blocks in `text`, in order."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    start, number = text.find(OPEN), 0
    while start >= 0:
        number += 1
        body_at = start + len(OPEN)
        end = text.find(CLOSE, body_at)
        if end < 0:
            errors.append(f"tool call {number}: {OPEN} without {CLOSE} (the turn ended first)")
            break
        body = text[body_at:end].strip()
        try:
            calls.append(read_call(body))
        except ValueError as exc:
            errors.append(f"tool call {number}: {exc}: {body[:200]!r}")
        start = text.find(OPEN, end + len(CLOSE))
    return calls, errors


def leading_text(text: str) -> str:
    """The text before a turn's first tool call, stripped (hermes)."""
    return text.split(OPEN, 1)[0].strip()


def read_call(body: str) -> ToolCall:
    """One call's JSON as `{"name", "arguments"}`; ValueError saying what is wrong."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(call, dict):
        raise ValueError("not a JSON object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('no "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f'"arguments" is a string but not JSON ({exc.msg})') from exc
    if not isinstance(arguments, dict):
        raise ValueError('"arguments" is not a JSON object')
    return {"name": name, "arguments": arguments}


# `--env-tool-call-parser`: name -> parser (None: the environment gets the text only).
PARSERS: dict[str, Parser | None] = {"hermes": parse_hermes, "none": None}
