"""Chat messages reach a chat template as SGLang 0.5.23 hands them (services/common/
chat_messages.py), held to SGLang's own functions read from its installed source
(tests/sglang_surface.py): its reading of a template's content format and its processing of each
message's content. Before, a content given as a list of parts reached a text template as the
list itself (rendered as its Python form), and null fields reached every template."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.common.chat_messages import (
    MESSAGE_FIELDS,
    MessageError,
    as_template_messages,
    content_format,
    template_of,
)
from services.rollout_router.gateway.chat_input import encode_prompt
from tests.sglang_surface import template_messages, template_utils

TEMPLATES = {
    "text": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "text, attribute": "{% for message in messages %}{{ message.content | trim }}{% endfor %}",
    "parts": "{% for message in messages %}{% for part in message['content'] %}"
    "{{ part['text'] }}{% endfor %}{% endfor %}",
    "parts, filtered": "{% for msg in messages %}{% for c in msg.content | "
    "selectattr('type', 'equalto', 'text') %}{{ c.text }}{% endfor %}{% endfor %}",
    "parts, sliced": "{% for m in messages %}{% for c in m['content'][1:] %}{{ c.text }}"
    "{% endfor %}{% endfor %}",
    "parts, another name": "{% for turn in messages %}{% for c in turn.content %}{{ c }}"
    "{% endfor %}{% endfor %}",
    "names a medium": "{# vision #}{% for m in messages %}{{ m.content }}{% endfor %}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "does not parse": "{% for %}",
}

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {
        "role": "Assistant",
        "content": None,
        "name": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "4"}] * 2},
    {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "x"}],
    },
    {"role": "user", "content": "plain", "name": "bob", "extra": 1},
    {"role": "developer", "content": "", "reasoning_content": "r"},
]


def dumped(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as SGLang's message class dumps it: a user message its role and content, any
    other its class's fields (null when not given), the role in lower case."""
    fields = MESSAGE_FIELDS[:2] if message["role"] == "user" else MESSAGE_FIELDS
    return {k: message.get(k) for k in fields} | {"role": message["role"].lower()}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_messages_reach_each_template_as_sglang_hands_them(name: str) -> None:
    template = TEMPLATES[name]
    form = content_format(template)
    assert form == template_utils().detect_jinja_template_content_format(template)
    ours = as_template_messages(MESSAGES, form)
    theirs = template_messages([dumped(m) for m in MESSAGES], template)
    assert ours == theirs
    assert [list(m) for m in ours] == [list(m) for m in theirs], "the same key order"


def test_the_formats_read_from_the_templates() -> None:
    parts = {"parts", "parts, filtered", "parts, sliced", "names a medium"}
    assert {n for n in TEMPLATES if content_format(TEMPLATES[n]) == "openai"} == parts
    text = as_template_messages(MESSAGES[:2], "string")
    assert text == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a b"},
    ]


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"role": "ipython", "content": "x"}, "messages[0].role must be one of system, user"),
        ({"role": "user", "content": None}, "messages[0].content: a user message needs"),
        ({"role": "user", "content": 3}, "must be a string, a list of parts or null"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            "messages[0].content[0]: a part must be",
        ),
        (
            {"role": "user", "content": [{"type": "thinking", "thinking": "t"}]},
            "thinking parts are only valid in assistant messages",
        ),
        ("hello", "messages[0] must be an object"),
    ],
)
def test_a_message_sglang_refuses_or_tandem_cannot_train_is_named(message: Any, words: str) -> None:
    with pytest.raises(MessageError, match=re.escape(words)):
        as_template_messages([message], "string")


def test_a_prompt_of_text_parts_renders_as_its_texts_joined(chat_tokenizer: Any) -> None:
    """The router's one way of rendering chat messages (dataset rows, environments, sessions)."""
    assert content_format(template_of(chat_tokenizer, None)) == "string"
    parts = [{"role": "user", "content": [{"type": "text", "text": "1"}] * 2}]
    assert encode_prompt(chat_tokenizer, parts, True) == encode_prompt(
        chat_tokenizer, [{"role": "user", "content": "1 1"}], True
    )
    named = {"default": "{{ messages[0].content }}", "tool_use": TEMPLATES["parts"]}
    assert template_of(type("T", (), {"chat_template": named})(), [{}]) == TEMPLATES["parts"]


@pytest.fixture(scope="module")
def chat_tokenizer(toy_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tests.helpers import with_chat_template
    from tests.test_router_agents import CHAT_TEMPLATE

    out = tmp_path_factory.mktemp("chatmessages") / "model"
    return AutoTokenizer.from_pretrained(with_chat_template(toy_model_dir, out, CHAT_TEMPLATE))
