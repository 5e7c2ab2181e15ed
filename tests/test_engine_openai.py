"""The engine's OpenAI-compatible routes, driven by the official `openai` client.

The toy model is copied with a small chat template so `/v1/chat/completions` has one to render.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


@pytest.fixture(scope="module")
def engine(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from conftest import ServiceProcess

    model = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(toy_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    service = ServiceProcess(
        ["engine", "--model", str(model), "--port", "0", "--served-model-name", "toy"],
        tmp_path_factory.mktemp("engine"),
        "engine",
    )
    yield service
    service.stop()


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=f"{engine.url}/v1", api_key="unused", timeout=60)


def native(engine, body: dict) -> dict:  # type: ignore[no-untyped-def]
    return httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()


def test_models_lists_the_served_model(client) -> None:  # type: ignore[no-untyped-def]
    assert [m.id for m in client.models.list().data] == ["toy"]


def test_completion_matches_native_generate_with_logprobs(engine, client) -> None:  # type: ignore[no-untyped-def]
    out = client.completions.create(
        model="toy",
        prompt="12>",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    ref = native(
        engine,
        {
            "text": "12>",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        },
    )
    choice = out.choices[0]
    assert choice.text == ref["text"]
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx(
        [e[0] for e in ref["meta_info"]["output_token_logprobs"]], abs=1e-6
    )
    assert len(choice.logprobs.top_logprobs) == 5 and all(
        len(t) <= 2 for t in choice.logprobs.top_logprobs
    )
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 5


def test_completion_n_and_stop_string(client) -> None:  # type: ignore[no-untyped-def]
    out = client.completions.create(
        model="toy",
        prompt=["12>", "34>"],
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=5,
    )
    assert len(out.choices) == 6
    assert [c.index for c in out.choices] == list(range(6))
    full = (
        client.completions.create(
            model="toy", prompt="12>", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[3]
    cut = client.completions.create(
        model="toy",
        prompt="12>",
        max_tokens=10,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["matched_stop"] == stop
    assert cut.choices[0].text == full[: full.find(stop)]


def test_chat_completion_uses_the_chat_template_and_returns_meta_info(engine, client) -> None:  # type: ignore[no-untyped-def]
    out = client.chat.completions.create(
        model="toy",
        messages=[{"role": "user", "content": "12"}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_meta_info": True, "ignore_eos": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    ref = native(
        engine,
        {
            "input_ids": [4 + 1, 4 + 2, 14],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        },
    )
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == [5, 6, 14]
    assert extra["response_token_ids"] == ref["output_ids"]
    assert [e[1] for e in extra["meta_info"]["output_token_logprobs"]] == ref["output_ids"]
    assert len(choice.logprobs.content) == 4
    assert all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)


def test_chat_streaming_deltas_add_up_to_the_full_answer(client) -> None:  # type: ignore[no-untyped-def]
    kwargs = {
        "model": "toy",
        "messages": [{"role": "user", "content": "7"}],
        "max_tokens": 6,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
    ]
    assert "".join(pieces) == full


def test_openai_errors_are_400_with_the_field_named(engine) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(
        f"{engine.url}/v1/completions", json={"model": "toy", "prompt": "1", "temperature": -1}
    )
    assert resp.status_code == 400 and "temperature" in resp.text
    resp = httpx.post(f"{engine.url}/v1/chat/completions", json={"model": "toy", "messages": []})
    assert resp.status_code == 400 and "messages" in resp.text


def test_sglang_fields_it_lacks_are_400_on_openai(engine) -> None:  # type: ignore[no-untyped-def]
    """They were dropped: a request for a LoRA adapter was answered by the base model, one for
    hidden states without them (/generate refused them already)."""
    for route, body in (
        ("/v1/completions", {"prompt": "1"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]}),
    ):
        for field, value in (("lora_path", "adapter"), ("return_hidden_states", True)):
            resp = httpx.post(f"{engine.url}{route}", json={**body, field: value, "max_tokens": 2})
            assert resp.status_code == 400, (route, field, resp.text)
            assert f"{field} is not supported by the reference engine" in resp.text
        plain = httpx.post(f"{engine.url}{route}", json={**body, "lora_path": None})
        assert plain.status_code == 200, plain.text  # (unset: as SGLang without LoRA)
