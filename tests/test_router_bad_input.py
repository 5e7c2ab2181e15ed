"""A bad request to the router is a 4xx with the reason, never a 5xx or a hang; agent sessions
(turns and rewards) and control routes need the run's token. A real router in front of a real
reference engine (the toy model with a chat template: a context of 64 tokens)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.sample_buffer import RedisServer
from tests.helpers import router_args, with_chat_template

TOKEN = "router-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEMPLATE = (
    "<bos>{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}"
    "{% if m['role'] == 'user' %}>{% else %}<eos>{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def chat_model(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(toy_model_dir, tmp_path_factory.mktemp("chat") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def router(
    redis_server: RedisServer, chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One engine and one router for the module (each test uses its own session ids)."""
    from conftest import ServiceProcess

    workdir = tmp_path_factory.mktemp("router")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_API_TOKEN", TOKEN)
        engine = ServiceProcess(
            ["engine", "--model", str(chat_model), "--port", "0"], workdir, "engine"
        )
        args = ["router", "--port", "0", "--engine-urls", engine.url, "--model", str(chat_model)]
        args += ["--redis-url", redis_server.url, "--run-id", "router-bad-input"]
        args += ["--no-rollout", "--max-request-bytes", str(8 << 20)]
        router = ServiceProcess(args, workdir, "router")
    yield router.url
    router.stop()
    engine.stop()


def turn(router: str, body: Any, auth: bool = True, session: str = "s1") -> httpx.Response:
    headers = {"X-Session-Id": session, **(AUTH if auth else {})}
    return httpx.post(router + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_bad_session_turns_are_400_naming_the_field_and_engine_refusals_pass_through(
    router: str,
) -> None:
    cases: list[tuple[Any, str]] = [
        ({"messages": [[None, None]]}, "messages[0]"),
        ({"messages": ["hello"]}, "messages[0]"),
        ({"messages": [{"role": 1, "content": "1"}]}, "messages[0].role"),
        ({"messages": "12"}, "messages"),
        ({"messages": [{"role": "robot", "content": "1"}]}, "messages[0].role must be one of"),
        ({"messages": user("12"), "max_tokens": -5}, "max_tokens"),
        ({"messages": user("12"), "max_tokens": "many"}, "max_tokens"),
        ({"messages": user("12"), "temperature": -1}, "temperature"),
        ({"messages": user("12"), "top_p": 5}, "top_p"),
        ({"messages": user("12"), "stop": 3}, "stop"),
        ({"messages": user("12"), "n": 2}, "n"),
        ({"messages": user("12"), "stream": "true"}, "stream must be true or false"),
        ({"messages": user("12"), "logprobs": "yes"}, "logprobs must be true or false"),
        ([1, 2], "JSON object"),
    ]
    for body, field in cases:
        reply = turn(router, body)
        assert reply.status_code == 400, (body, reply.text)
        assert field in reply.json()["detail"], (body, reply.text)
    # the engine refuses what does not fit its context: its status and reason reach the agent
    reply = turn(router, {"messages": user("12"), "max_tokens": 100000})
    assert reply.status_code == 400 and "context" in reply.json()["detail"]
    reply = turn(router, {"messages": user("1" * 200)})
    assert reply.status_code == 400 and "context" in reply.json()["detail"]
    # a body that is not an object is refused on the path without a session, too
    reply = httpx.post(router + "/v1/chat/completions", json=[1], timeout=30)
    assert reply.status_code == 400


def test_a_reward_given_as_text_is_422_and_the_session_stays_open(router: str) -> None:
    """`{"reward": "1"}` was read as 1: an answer posted for a score trained silently."""
    assert turn(router, {"messages": user("12"), "max_tokens": 2}, session="s-text").is_success
    url = router + "/sessions/s-text/reward"
    for body, field in [
        ({"reward": "1"}, "reward"),
        ({"reward": True}, "reward"),
        ({"reward": 1, "group": "g", "group_size": "2"}, "group_size"),
    ]:
        reply = httpx.post(url, json=body, headers=AUTH, timeout=30)
        assert reply.status_code == 422 and field in reply.json()["detail"][0]["loc"], reply.text
    reply = httpx.post(url, json={"reward": 1}, headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text


def test_a_reward_whose_group_size_contradicts_its_group_is_409(router: str) -> None:
    """The group completed at the smaller size and the later sessions' group never did (their
    samples were dropped at the sessions' expiry)."""
    for session in ("s-g1", "s-g2", "s-g3"):
        assert turn(router, {"messages": user("12"), "max_tokens": 2}, session=session).is_success

    def post(session: str, size: int) -> httpx.Response:
        body = {"reward": 1.0, "group": "size-test", "group_size": size}
        return httpx.post(f"{router}/sessions/{session}/reward", json=body, headers=AUTH)

    assert post("s-g1", 3).json()["status"] == "pending"
    refused = post("s-g2", 2)
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"].startswith(
        "group 'size-test' has 1 of its 3 sessions (group_size 3 in its first reward), but this "
        "reward says group_size 2"
    )
    assert post("s-g2", 3).json() == {"status": "pending", "group": "size-test", "samples": 1}
    assert post("s-g3", 3).json()["status"] == "put"


def test_a_refused_turn_leaves_the_connection_open_for_the_next_one(router: str) -> None:
    valid = {"messages": user("12"), "max_tokens": 2}
    with httpx.Client(headers={"X-Session-Id": "s-keep", **AUTH}, timeout=60) as client:
        for bad in ({"messages": [[None, None]]}, [1, 2]):
            refused = client.post(router + "/v1/chat/completions", json=bad)
            reply = client.post(router + "/v1/chat/completions", json=valid)
            assert reply.status_code == 200, reply.text
            assert refused.status_code == 400, refused.text


def test_sigterm_ends_a_router_whose_requests_wait_on_a_paused_engine(
    start_service, engines, buffer, toy_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    """The paused engine here is the SGLang stand-in: only SIGTERM can end the request."""
    engine = engines()
    args = router_args(buffer, toy_model_dir, [engine.url], "--no-rollout")
    service = start_service("router", [*args, "--graceful-shutdown-s", "1"])
    assert httpx.post(engine.url + "/pause_generation", json={"mode": "in_place"}).is_success
    body = {"input_ids": [1, 5, 14], "sampling_params": {"max_new_tokens": 2}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, service.url + "/generate", json=body, timeout=60)
        time.sleep(0.5)  # the request waits on the paused engine (nothing else would end it)
        assert not held.done()
        os.kill(service.proc.pid, signal.SIGTERM)
        service.proc.wait(timeout=20)  # bounded by --graceful-shutdown-s, not by the engine
        reply = held.result(timeout=20)  # a 503 with the reason (it was a plain-text 500)
        assert reply.status_code == 503, reply.text
        assert "--graceful-shutdown-s 1" in reply.json()["detail"]
    httpx.post(engine.url + "/continue_generation", json={})  # lets the stand-in stop at once


def test_a_turn_without_max_tokens_is_clipped_to_the_context(router: str) -> None:
    reply = turn(router, {"messages": user("12")})  # 1024 default + prompt > 64 tokens
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["total_tokens"] <= 64


def test_a_huge_message_is_refused_before_it_is_tokenised(router: str) -> None:
    started = time.monotonic()
    reply = turn(router, {"messages": user("1" * 5_000_000)})
    assert reply.status_code == 400 and "characters" in reply.json()["detail"]
    assert time.monotonic() - started < 30
    reply = httpx.post(
        router + "/v1/chat/completions", content=b" " * (9 << 20), headers=AUTH, timeout=30
    )
    assert reply.status_code == 413 and "--max-request-bytes" in reply.text


def test_sessions_and_control_need_the_token_reads_and_generation_stay_open(router: str) -> None:
    body = {"messages": user("12"), "max_tokens": 4}
    assert turn(router, body, auth=False, session="s-auth").status_code == 401
    assert turn(router, body, session="s-auth").status_code == 200
    reward = router + "/sessions/s-auth/reward"
    assert httpx.post(reward, json={"reward": 1.0}).status_code == 401
    assert httpx.post(reward, json={"reward": 1.0}, headers=AUTH).status_code == 200
    assert httpx.post(router + "/pause_generation", json={}).status_code == 401
    reply = httpx.post(router + "/pause_generation", json={"mode": "later"}, headers=AUTH)
    assert reply.status_code == 422 and "mode" in reply.text
    body = {"input_ids": [1, 5, 14], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(router + "/generate", json=body).status_code == 200
    assert httpx.get(router + "/workers").status_code == 200


def test_worker_urls_are_checked(router: str) -> None:
    for bad in ("not a url", "", "127.0.0.1:30000"):
        reply = httpx.post(router + "/workers", json={"url": bad}, headers=AUTH)
        assert reply.status_code == 422 and "url" in reply.text, bad
    reply = httpx.post(router + "/add_worker", params={"url": "nope"}, headers=AUTH)
    assert reply.status_code == 422


def test_bodies_python_parses_but_cannot_write_back_are_4xx_on_every_route(router: str) -> None:
    """A lone surrogate escape (Python's JSON parser takes it, no UTF-8 encoder writes it) and an
    integer past 64 bits: each was a 500 where a route echoed, forwarded or opened it."""
    json_type = {**AUTH, "content-type": "application/json"}
    lone = '"\\ud800"'
    for method, path, body, status in [
        ("POST", "/abort_request", f'{{"rid": {lone}}}', 400),
        ("POST", "/pause_generation", f'{{"mode": {lone}}}', 400),
        ("POST", "/workers", f'{{"url": {lone}}}', 400),
        ("PATCH", "/rollout/config", f'{{"prompt_data": {lone}}}', 400),
        ("PATCH", "/rollout/config", f"{{{lone}: 1}}", 400),
        (
            "POST",
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": {lone}}}]}}',
            400,
        ),
        ("POST", "/generate", f'{{"text": {lone}}}', 400),
        ("PATCH", "/rollout/config", "-" + "1" * 40, 422),
        ("POST", "/workers", '{"url": ' + "1" * 40 + "}", 422),
    ]:
        reply = httpx.request(method, router + path, content=body, headers=json_type)
        assert reply.status_code == status, (path, body, reply.text)
        assert ("JSON" if status == 400 else '"loc"') in reply.text, reply.text
    # bytes that are no UTF-8 text, without a content type (FastAPI then parses them as JSON)
    for method, path in [
        ("POST", "/workers"),
        ("PATCH", "/rollout/config"),
        ("POST", "/abort_request"),
        ("POST", "/sessions/s/reward"),
    ]:
        reply = httpx.request(method, router + path, content=b"\xff\xfe", headers=AUTH)
        assert reply.status_code == 422 and '"loc":["body"' in reply.text, (path, reply.text)
    paired = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00 12"}], "max_tokens": 2}'
    reply = httpx.post(router + "/v1/chat/completions", content=paired, headers=json_type)
    assert reply.status_code == 200, "a surrogate pair is a character: taken"


def test_the_router_openapi_has_unique_ids_and_publishes_bodies(router: str) -> None:
    spec = httpx.get(router + "/openapi.json").json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path in ("/generate", "/v1/chat/completions", "/pause_generation", "/workers"):
        assert "requestBody" in spec["paths"][path]["post"], path


async def test_health_is_503_once_the_worker_health_checks_died() -> None:
    import asyncio

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from services.rollout_router.balancer.routes_engine import router as engine_routes
    from services.rollout_router.balancer.workers import WorkerPool
    from services.rollout_router.config import WorkerPoolConfig

    pool = WorkerPool(WorkerPoolConfig())

    async def broken() -> None:
        raise RuntimeError("bug in the health loop")

    pool._health_task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    app = FastAPI()
    app.include_router(engine_routes)
    app.state.pool = pool
    reply = TestClient(app).get("/health")
    assert reply.status_code == 503 and "bug in the health loop" in reply.json()["error"]
