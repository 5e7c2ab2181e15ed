"""Chat messages as SGLang 0.5.23 hands them to a chat template, so that a prompt the router
renders (a dataset row's, an environment's observation, an agent session's turn) and trains on
reads as the served model's will when a client sends the same messages to SGLang's
`/v1/chat/completions` (and the reference engine's chat route renders them the same way).

What SGLang does to each message before the template (read in its serving_chat.py, protocol.py
and parser/jinja_template_utils.py): it validates it as its message class and dumps it, so a
user message keeps `role` and `content` only and another keeps its class's fields
(`MESSAGE_FIELDS`), with the role in lower case (one of `ROLES`, else the request is refused);
keys whose value is null are left out and a null content becomes ""; a content given as a list
of parts becomes one text, its text parts joined by spaces, for a template that reads content as
text ("string"), and stays a list of `{"type": "text", "text"}` parts for one that loops over
it ("openai", `content_format`), a tool message's then joined too. Parts other than text are
refused here (Tandem trains on text); thinking parts are left out, as SGLang leaves them.
"""

from __future__ import annotations

import functools
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")
# The fields of SGLang's generic message class, in its order (a user message: the first two).
MESSAGE_FIELDS = (
    "role",
    "content",
    "tool_call_id",
    "name",
    "phase",
    "reasoning_content",
    "tool_calls",
    "tools",
    "prefix",
)
LEFT_OUT_PARTS = ("thinking", "reasoning")  # accepted, not in the prompt
MEDIA_WORDS = ("image", "audio", "video", "vision")  # a template naming one takes parts
CONTENT_OWNERS = ("message", "msg", "m")  # `for part in message.content` and the like


class MessageError(ValueError):
    """A message SGLang would refuse, or a part Tandem cannot train on; names it."""


@functools.lru_cache(maxsize=16)
def content_format(template: str) -> str:
    """ "openai" when the chat template takes a message's content as a list of parts (it
    loops over `message.content`, `msg.content` or `m.content`, or names a medium anywhere),
    else "string": SGLang 0.5.23's reading of a template."""
    if any(word in template for word in MEDIA_WORDS):
        return "openai"
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # (parsed as transformers parses it: its extensions' tags included)
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # (the render then fails in the template's own words)
        return "string"
    loops = (_content_of_a_message(loop.iter, nodes) for loop in tree.find_all(nodes.For))
    return "openai" if any(loops) else "string"


def _content_of_a_message(node: Any, nodes: Any) -> bool:
    """Whether a loop's iterable is a message's content (under filters, tests and slices)."""
    while isinstance(node, nodes.Filter | nodes.Test) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
    if isinstance(node, nodes.Getattr):
        key = node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        key = node.arg.value
    else:
        return False
    owner = node.node
    return key == "content" and isinstance(owner, nodes.Name) and owner.name in CONTENT_OWNERS


def template_of(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str:
    """The chat template `apply_chat_template` renders with ("" when there is none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: transformers' choice
        named = template.get("tool_use") if tools else None
        template = named or template.get("default") or ""
    return template if isinstance(template, str) else ""


def template_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """`messages` as SGLang hands them to `tokenizer`'s chat template (the one rendered with
    `tools`): `as_template_messages` in that template's `content_format`."""
    return as_template_messages(messages, content_format(template_of(tokenizer, tools)))


def as_template_messages(messages: list[dict[str, Any]], form: str) -> list[dict[str, Any]]:
    """`messages` as SGLang hands them to a template of content format `form` (the module's
    docstring); MessageError naming a message or part it would refuse or Tandem cannot train."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MessageError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise MessageError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
            )
        role = role.lower()
        fields = MESSAGE_FIELDS[:2] if role == "user" else MESSAGE_FIELDS
        kept = {k: message.get(k) for k in fields} | {"role": role}  # (the class's order)
        content = kept["content"]
        if content is None:
            if role == "user":
                raise MessageError(f"messages[{i}].content: a user message needs a content")
            kept["content"] = ""
        elif isinstance(content, list):
            texts = _texts(content, i, role)
            if form == "openai":  # (a list of parts goes last, as SGLang puts it)
                del kept["content"]
            parts = [{"type": "text", "text": text} for text in texts]
            kept["content"] = " ".join(texts) if form == "string" or role == "tool" else parts
        elif not isinstance(content, str):
            raise MessageError(f"messages[{i}].content must be a string, a list of parts or null")
        out.append({k: v for k, v in kept.items() if v is not None})
    return out


def joined_text(messages: list[dict[str, Any]]) -> str:
    """`messages` without a chat template: their contents one after the other, checked and made
    text as for a template that reads content as text (MessageError as `as_template_messages`)."""
    return "".join(m["content"] for m in as_template_messages(messages, "string"))


def _texts(parts: list[Any], index: int, role: str) -> list[str]:
    """The texts of a content's parts, an assistant's thinking parts left out; MessageError
    naming another."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in LEFT_OUT_PARTS and role != "assistant":
            raise MessageError(
                f"messages[{index}].content[{j}]: thinking parts are only valid in assistant "
                "messages"
            )
        elif kind not in LEFT_OUT_PARTS:
            raise MessageError(
                f"messages[{index}].content[{j}]: a part must be "
                '{"type": "text", "text": "..."}: Tandem trains on text only '
                f"(got type {str(kind)[:40]!r})"
            )
    return texts
