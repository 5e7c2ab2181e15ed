"""A session's chat turn, checked before any work: 400 naming the field, never a 500; and chat
messages as the model sees them (`encode_prompt`, `TemplateKwargs`: the chat template), for
sessions, datasets and environments alike.

Knows OpenAI's chat request fields and SGLang's sampling parameter names; knows nothing about
HTTP or engines. `check_messages` runs before the chat template; `prompt_char_limit` is a cheap
upper bound that refuses a prompt too long for the context without tokenising it (a token never
decodes to more characters than its longest vocabulary entry, so more characters than
context x that length cannot fit).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from services.common.chat_messages import template_messages


class TurnError(ValueError):
    """A bad chat request; the message names the field."""


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of {role, content} objects, or TurnError naming the bad entry."""
    if not isinstance(messages, list) or not messages:
        raise TurnError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TurnError(
                f"messages[{i}] must be an object with role and content, "
                f"got {type(message).__name__}"
            )
        if not isinstance(message.get("role"), str):
            raise TurnError(f"messages[{i}].role must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise TurnError(f"messages[{i}].content must be a string, a list of parts or null")
    return [with_parsed_arguments(m, i) for i, m in enumerate(messages)]


def with_parsed_arguments(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message's tool calls with their JSON `arguments` as objects, as SGLang hands
    them to the chat template (a template then writes them as it writes its own); TurnError
    when one is not a JSON object."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise TurnError(
                    f"messages[{index}].tool_calls: function.arguments must be a JSON object"
                )
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of every message's content (list contents counted as their JSON)."""
    total = 0
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(json.dumps(content or ""))
    return total


@functools.cache
def _longest_token_chars(tokenizer: Any) -> int:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocab), default=64)


def prompt_char_limit(tokenizer: Any, context_length: int) -> int:
    """More content characters than this cannot fit in `context_length` tokens."""
    return context_length * _longest_token_chars(tokenizer)


def model_context_length(tokenizer: Any) -> int | None:
    """`max_position_embeddings` of the tokenizer's model directory, if it has a config.json."""
    config = Path(str(getattr(tokenizer, "name_or_path", ""))) / "config.json"
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _int(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise TurnError(f"{name} must be an integer >= {low}, got {str(value)[:50]!r}")
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):  # ("false" would be taken for true)
        raise TurnError(f"{name} must be true or false, got {str(value)[:50]!r}")
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise TurnError(f"{name} must be a number in [{low}, {high}], got {str(value)[:50]!r}")
    return float(value)


# A session turn is trained on: its tokens must be drawn from the model's own distribution, the
# one the trainer's log-probs see. A field that would bend it is refused unless neutral.
NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    # (each was dropped: the turn drawn from the model without them, unsaid)
    "lora_path": None,  # another model's distribution
    "min_tokens": 0,  # the end-of-sequence token masked until then
    "ignore_eos": False,
}
OFF_POLICY = "the trainer's log-probs would not be the ones the turn was drawn with"


def check_neutral(body: dict[str, Any]) -> None:
    """TurnError naming a field that would draw the turn's tokens off the policy."""
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise TurnError(
                f"{name} {json.dumps(value)[:50]}: a session turn is trained on, and {name} draws its "
                f"tokens from another distribution than the model's ({OFF_POLICY}); leave it out"
            )


FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def as_sglang_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """`tool` as SGLang 0.5.23 hands it to the chat template (its `Tool.model_dump()`), so that
    a prompt trained on reads as the served model's will: the function's known fields only, an
    absent `description` or `parameters` as null, `strict` and `defer_loading` only when set (the
    tool's `defer_loading` passed down), the client's key order first; the tool's
    `defer_loading` kept, null when absent."""
    given = tool["function"]
    function = {k: given.get(k) for k in FUNCTION_FIELDS}
    if function["defer_loading"] is None:
        function["defer_loading"] = tool.get("defer_loading")
    for key in ("strict", "defer_loading"):
        if function[key] is None:
            del function[key]
    order = [k for k in given if k in function] + [k for k in function if k not in given]
    return {
        "type": tool.get("type", "function"),
        "function": {k: function[k] for k in order},
        "defer_loading": tool.get("defer_loading"),
    }


def template_inputs(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """(the tools the chat template lists, as SGLang lists them (`as_sglang_tool`); None
    without tools or with tool_choice "none"), and the request's chat_template_kwargs."""
    tools, choice = body.get("tools"), body.get("tool_choice") or "auto"
    if tools is not None and not (
        isinstance(tools, list)
        and all(
            isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise TurnError('tools must be a list of {"type": "function", "function": {"name", ...}}')
    if choice not in ("auto", "none"):
        raise TurnError(
            f"tool_choice {str(choice)[:80]!r}: a session turn is trained on, and forcing a "
            f'tool call constrains its decoding ({OFF_POLICY}); use "auto" or "none"'
        )
    if body.get("continue_final_message"):  # (SGLang's: the last assistant message continued)
        raise TurnError(
            "continue_final_message: a session turn is rendered as a new assistant message "
            "after the messages, not as the continuation of the last one that SGLang would "
            "serve (the trained prompt would not be the served one); leave it out"
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TurnError("chat_template_kwargs must be an object")
    listed = [as_sglang_tool(t) for t in tools] if tools and choice == "auto" else None
    return listed, kwargs


def sampling_params(body: dict[str, Any], stop_token_ids: list[int]) -> dict[str, Any]:
    """SGLang sampling parameters of a chat turn, without `max_new_tokens` (the caller sets it
    from `requested_max_tokens` and the context)."""
    if _int(body, "n", 1) not in (None, 1):
        raise TurnError("n must be 1 in a session (one conversation per session)")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise TurnError("stop must be a string or a list of strings")
    asked = body.get("stop_token_ids") or []  # (SGLang's; they were dropped unsaid)
    if not isinstance(asked, list) or not all(type(t) is int and t >= 0 for t in asked):
        raise TurnError("stop_token_ids must be a list of token ids (integers >= 0)")
    seed = _int(body, "seed", 0)
    top_p = _number(body, "top_p", 1.0, 1e-9, 1.0)
    for name, value, whole in (("top_p", top_p, 1.0), ("top_k", body.get("top_k", -1), -1)):
        if value != whole:  # (the temperature the trainer applies: each sample records it)
            raise TurnError(
                f"{name} {str(value)[:50]}: a session turn is trained on, and {name} draws its "
                f"tokens from part of the model's distribution ({OFF_POLICY}); leave it out"
            )
    return {
        "temperature": _number(body, "temperature", 1.0, 0.0, 100.0),
        "top_p": top_p,
        "top_k": -1,
        "n": 1,
        "stop_token_ids": stop_token_ids + [t for t in asked if t not in stop_token_ids],
        # (SGLang's, for the answer's text only: the trained tokens are the same; they were
        # dropped unsaid, a stop string always trimmed and special tokens always skipped)
        "skip_special_tokens": _flag(body, "skip_special_tokens", True),
        "no_stop_trim": _flag(body, "no_stop_trim", False),
        **({"stop": stop} if stop else {}),
        **({"sampling_seed": seed} if seed is not None else {}),
    }


def top_logprobs(body: dict[str, Any]) -> int:
    """How many alternatives a turn's log-probs list per token (OpenAI's `top_logprobs`, 0 to
    20, with `logprobs` true); TurnError naming it, or a `logprobs` that is no boolean."""
    if not isinstance(body.get("logprobs"), bool | None):  # ("yes" was taken for true)
        raise TurnError(f"logprobs must be true or false, got {str(body['logprobs'])[:50]!r}")
    top = _int(body, "top_logprobs", 0) or 0
    if top > 20 or (top and not body.get("logprobs")):
        raise TurnError(f"top_logprobs must be 0 to 20, with logprobs true; got {top}")
    return top


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    """`max_completion_tokens` or `max_tokens` as given (None when neither is)."""
    given = _int(body, "max_completion_tokens", 1)
    return given if given is not None else _int(body, "max_tokens", 1)


class TemplateKwargs:
    """`tokenizer`, its chat template given `kwargs` (--apply-chat-template-kwargs) at every
    render, under the render's own."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.kwargs = tokenizer, kwargs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **{**self.kwargs, **kwargs})


def encode_prompt(
    tokenizer: Any,
    prompt: Any,
    chat: bool,
    tools: list[dict[str, Any]] | None = None,
    **template: Any,
) -> tuple[int, ...]:
    """Prompt ids as the model sees them. Chat messages (or `chat=True`) go through the
    tokenizer's chat template with the generation prompt (and `tools`, for templates that list
    them; `template`: more variables), as SGLang hands them to it (`template_messages`:
    MessageError naming one it would refuse); plain text gets the tokenizer's own special
    tokens."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages = template_messages(tokenizer, messages, tools)
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **template
        )
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    return tuple(tokenizer(prompt)["input_ids"])
