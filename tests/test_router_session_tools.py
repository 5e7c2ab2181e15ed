"""Agent session turns with tools and chat-template variables, as an OpenAI client sends them to
SGLang: the tools are rendered by the chat template into the trained prompt, the model's tool
calls come back as `tool_calls`, and fields that would draw a trained turn off the policy are
refused. A real router in front of a real reference engine serving a model whose greedy turn is
a tool call (test_router_agents.write_tool_model)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.rollout_router.config import RouterConfig
from services.rollout_router.gateway.chat_input import TemplateKwargs, encode_prompt
from tests.helpers import read_all
from tests.test_router_agents import router_args
from tests.test_router_tool_calls import CALL, QUESTION, TOOLS, TURN_TEXT, write_tool_model

TOKEN = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("sessiontools") / "model")


@pytest.fixture
def router(buffer, tool_model_dir, start_service) -> str:  # type: ignore[no-untyped-def]
    engine = start_service("engine", ["engine", "--model", str(tool_model_dir), "--port", "0"])
    flags = ("--no-rollout", "--api-token", "s3cret")
    return start_service("router", router_args(buffer, tool_model_dir, [engine.url], *flags)).url


def turn(router: str, session: str, **body: object) -> httpx.Response:
    body = {"messages": QUESTION, "max_tokens": 40, "temperature": 0, **body}
    headers = {**TOKEN, "X-Session-Id": session}
    return httpx.post(router + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_session_turn_with_tools_renders_them_and_answers_the_calls_as_tool_calls(
    buffer, router: str, tool_model_dir: Path
) -> None:
    """Before, `tools` was dropped without a word: the model never saw them in its prompt, and
    its calls came back as plain text."""
    from transformers import AutoTokenizer

    answer = turn(router, "s1", tools=TOOLS).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", answer
    (call,) = choice["message"]["tool_calls"]  # (the turn's second call is malformed)
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}
    assert choice["message"]["content"] is None, "no text before the first call"
    plain = turn(router, "s2").json()["choices"][0]  # without tools: the text, as it was
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
    assert plain["message"]["content"].startswith("<tool_call>")
    none = turn(router, "s3", tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert "tool_calls" not in none["message"], "tool_choice none: tools not listed nor read"
    for session in ("s1", "s2", "s3"):
        reward = httpx.post(
            f"{router}/sessions/{session}/reward", json={"reward": 1}, headers=TOKEN
        )
        assert reward.status_code == 200, reward.text
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    prompts = {g.group_id: tokenizer.decode(g.samples[0].prompt_ids) for g in read_all(buffer)}
    assert "Tools: calculator" in prompts["session-s1"], "the trained prompt lists the tools"
    assert "Tools" not in prompts["session-s2"] and "Tools" not in prompts["session-s3"]


def test_fields_that_would_draw_a_trained_turn_off_the_policy_are_refused_naming_them(
    router: str,
) -> None:
    for body, words in [
        ({"presence_penalty": 0.5}, "presence_penalty 0.5: a session turn is trained on"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required"}, "forcing a tool call constrains"),
        ({"tools": [{"name": "calculator"}]}, "tools must be a list of"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be an object"),
        ({"top_k": 0}, "top_k 0: a session turn is trained on, and top_k draws its tokens"),
        ({"top_k": 5}, "top_k 5: a session turn is trained on, and top_k draws its tokens"),
        ({"top_p": 0.9}, "top_p 0.9: a session turn is trained on, and top_p draws its tokens"),
        ({"lora_path": "adapter"}, 'lora_path "adapter": a session turn is trained on'),
        ({"min_tokens": 3}, "min_tokens 3: a session turn is trained on"),
        ({"ignore_eos": True}, "ignore_eos true: a session turn is trained on"),
        ({"continue_final_message": True}, "continue_final_message: a session turn is"),
        ({"top_logprobs": 2}, "top_logprobs must be 0 to 20, with logprobs true; got 2"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be 0 to 20"),
    ]:
        reply = turn(router, "bad", **body)
        assert reply.status_code == 400 and words in reply.json()["detail"], (body, reply.text)
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "top_k": -1}
    neutral |= {"top_p": 1, "temperature": 0.7}  # (the sample records its temperature)
    neutral |= {"min_tokens": 0, "ignore_eos": False, "lora_path": None}
    neutral |= {"continue_final_message": False, "top_logprobs": 0}
    assert turn(router, "ok", **neutral).status_code == 200, "neutral values are taken"


def test_chat_template_variables_reach_every_render_and_a_turns_own_win(
    tool_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    tokenizer.chat_template = "{{ note | default('none') }}:{{ messages[0]['content'] }}"
    prompt = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(encode_prompt(tokenizer, prompt, True)) == "none:hi"
    flagged = TemplateKwargs(tokenizer, {"note": "flag"})  # --apply-chat-template-kwargs
    assert tokenizer.decode(encode_prompt(flagged, prompt, True)) == "flag:hi"
    assert tokenizer.decode(encode_prompt(flagged, prompt, True, note="turn")) == "turn:hi"
    config = RouterConfig(rollout=False)  # (no --model needed)
    config.data.apply_chat_template_kwargs = '["enable_thinking"]'
    with pytest.raises(ValueError, match="--apply-chat-template-kwargs must be a JSON object"):
        config.validate()
    config.data.apply_chat_template_kwargs = "{enable_thinking: false}"
    with pytest.raises(ValueError, match="--apply-chat-template-kwargs: not JSON"):
        config.validate()


def test_tools_reach_the_template_as_sglang_0_5_23_dumps_them() -> None:
    """SGLang renders `Tool.model_dump()` (protocol.py: Function keeps the client's key order,
    writes an absent description or parameters as null, strict and defer_loading only when
    set, drops unknown keys; Tool adds its defer_loading): a prompt trained on reads as the
    served model's."""
    from services.rollout_router.gateway.chat_input import as_sglang_tool

    given = {
        "type": "function",
        "function": {"parameters": {"type": "object"}, "name": "calc", "x": 1},
    }
    assert as_sglang_tool(given) == {
        "type": "function",
        "function": {"parameters": {"type": "object"}, "name": "calc", "description": None},
        "defer_loading": None,
    }
    assert list(as_sglang_tool(given)["function"]) == ["parameters", "name", "description"]
    deferred = {"function": {"name": "calc", "strict": True}, "defer_loading": True}
    assert as_sglang_tool(deferred) == {
        "type": "function",
        "function": {
            "name": "calc",
            "strict": True,
            "description": None,
            "parameters": None,
            "defer_loading": True,
        },
        "defer_loading": True,
    }
    order = ["name", "strict", "description", "parameters", "defer_loading"]
    assert list(as_sglang_tool(deferred)["function"]) == order


def test_an_assistant_turns_tool_call_arguments_reach_the_template_as_an_object(
    router: str,
) -> None:
    """As SGLang: a history's `function.arguments` (a JSON string, OpenAI's form) is parsed for
    the template, and one that is no JSON object is answered 400 naming the message."""
    from services.rollout_router.gateway.chat_input import check_messages

    call = {"id": "c1", "type": "function", "function": {"name": "calculator"}}
    said = {"role": "assistant", "content": "", "tool_calls": [call]}
    history = [*QUESTION, said, {"role": "tool", "content": "5"}]
    call["function"]["arguments"] = '{"expression": "2+3"}'
    (parsed,) = check_messages(history)[1]["tool_calls"]
    assert parsed["function"]["arguments"] == {"expression": "2+3"}
    assert call["function"]["arguments"] == '{"expression": "2+3"}', "the request is not changed"
    assert turn(router, "t1", messages=history, tools=TOOLS).status_code == 200
    call["function"]["arguments"] = "[1, 2]"
    reply = turn(router, "t2", messages=history, tools=TOOLS)
    assert reply.status_code == 400
    assert "messages[1].tool_calls: function.arguments must be a JSON object" in reply.text


def test_a_turns_no_stop_trim_and_skip_special_tokens_shape_its_text_as_sglangs_do(
    buffer, router: str
) -> None:
    """SGLang's `no_stop_trim` and `skip_special_tokens` were dropped without a word: the stop
    string always trimmed from the answer, special tokens always skipped. The trained tokens
    are the same either way."""
    for fields, content in [
        ({"stop": "</tool_call>"}, "<tool_call>" + CALL),
        ({"stop": "</tool_call>", "no_stop_trim": True}, f"<tool_call>{CALL}</tool_call>"),
        ({"no_stop_trim": True}, TURN_TEXT),  # the end of turn is a special token, skipped
        ({"no_stop_trim": True, "skip_special_tokens": False}, TURN_TEXT + "<|im_end|>"),
    ]:
        answer = turn(router, "s1", **fields)
        assert answer.json()["choices"][0]["message"]["content"] == content, (fields, answer.text)
    reward = httpx.post(f"{router}/sessions/s1/reward", json={"reward": 1}, headers=TOKEN)
    assert reward.status_code == 200, reward.text
    (group,) = read_all(buffer)
    texts = [s.response_text for s in group.samples]
    assert len(group.samples) == 4 and texts[1].endswith("</tool_call>"), texts
