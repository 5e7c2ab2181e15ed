"""Balancing and health through the router process (real CLI, `--no-rollout`) and fake engines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.helpers import router_args, wait_until

GEN = {"input_ids": [1, 4, 5, 14], "sampling_params": {"n": 2, "max_new_tokens": 4}}


@pytest.fixture
def free_port_factory() -> Callable[[], int]:
    def _free() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    return _free


def start_router(start_service, buffer, urls: list[str], *extra: str):
    args = [
        "router",
        "--port",
        "0",
        "--no-rollout",
        "--redis-url",
        buffer.config.redis_url,
        "--run-id",
        buffer.config.run_id,
        "--health-interval-s",
        "0.2",
        *extra,
    ]
    if urls:
        args += ["--engine-urls", *urls]
    return start_service("router", args)


def workers_by_url(router) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers").json()["workers"]}


def test_workers_are_added_listed_and_removed_through_both_apis(buffer, start_service, engines):
    a, b = engines(), engines()
    router = start_router(start_service, buffer, [])
    assert httpx.get(router.url + "/workers").json() == {"workers": []}
    assert httpx.post(router.url + "/generate", json=GEN).status_code == 503
    reply = httpx.post(router.url + "/workers", json={"url": a.url})
    added = reply.json()
    assert reply.status_code == 202 and added["status"] == "admitted" and added["healthy"]
    assert httpx.post(router.url + "/add_worker", params={"url": b.url}).status_code == 200
    assert set(httpx.get(router.url + "/list_workers").json()["urls"]) == {a.url, b.url}
    assert httpx.post(router.url + "/generate", json=GEN).status_code == 200
    assert httpx.delete(f"{router.url}/workers/{added['id']}").status_code == 200
    assert httpx.post(router.url + "/remove_worker", params={"url": b.url}).status_code == 200
    assert httpx.get(router.url + "/list_workers").json()["urls"] == []
    gone = httpx.delete(f"{router.url}/workers/{added['id']}")
    assert gone.status_code == 404 and gone.json()["detail"] == f"no worker '{added['id']}'"
    dead = httpx.post(router.url + "/add_worker", params={"url": "http://127.0.0.1:9"})
    assert dead.status_code == 502 and "http://127.0.0.1:9" in dead.json()["detail"]


def test_a_worker_posted_before_it_is_up_is_admitted_once_it_answers(
    buffer, start_service, engines, free_port_factory
):
    port = free_port_factory()
    url = f"http://127.0.0.1:{port}"
    router = start_router(start_service, buffer, [])
    reply = httpx.post(router.url + "/workers", json={"url": url})
    assert reply.status_code == 202 and reply.json()["status"] == "pending"
    assert httpx.post(router.url + "/generate", json=GEN).status_code == 503, "not admitted yet"
    engines("--port", str(port))
    wait_until(lambda: workers_by_url(router)[url]["healthy"], "admission by the health checks")
    assert httpx.post(router.url + "/generate", json=GEN).status_code == 200


def test_mutating_routes_need_the_bearer_token_when_one_is_set(buffer, start_service, engines):
    a = engines()
    router = start_router(start_service, buffer, [], "--api-token", "s3cret")
    assert httpx.post(router.url + "/workers", json={"url": a.url}).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert httpx.post(router.url + "/workers", json={"url": a.url}, headers=bad).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.post(router.url + "/workers", json={"url": a.url}, headers=good).status_code == 202
    assert httpx.get(router.url + "/workers").status_code == 200, "reads need no token"
    assert httpx.post(router.url + "/flush_cache", json={}).status_code == 401
    assert httpx.post(router.url + "/flush_cache", json={}, headers=good).status_code == 200
    assert httpx.post(router.url + "/generate", json=GEN).status_code == 200, "no token to generate"


def test_a_dead_worker_is_evicted_and_readmitted_only_at_the_current_weight_version(
    buffer, start_service, engines, free_port_factory
):
    port = free_port_factory()
    a, b = engines("--port", str(port)), engines()
    router = start_router(start_service, buffer, [a.url, b.url], "--health-failures", "2")
    a.stop()
    wait_until(lambda: not workers_by_url(router)[a.url]["healthy"], "eviction of the dead worker")
    for _ in range(4):
        assert httpx.post(router.url + "/generate", json=GEN).status_code == 200
    httpx.post(
        b.url + "/update_weights_from_disk", json={"model_path": "/m", "weight_version": "2"}
    )
    wait_until(lambda: workers_by_url(router)[b.url]["weight_version"] == 2, "b at version 2")
    a2 = engines("--port", str(port), "--weight-version", "1")
    wait_until(lambda: workers_by_url(router)[a.url]["weight_version"] == 1, "a seen at version 1")
    assert not workers_by_url(router)[a.url]["healthy"], "version 1 < 2: not re-admitted"
    httpx.post(
        a2.url + "/update_weights_from_disk", json={"model_path": "/m", "weight_version": "2"}
    )
    wait_until(lambda: workers_by_url(router)[a.url]["healthy"], "re-admission at version 2")


def test_with_default_health_settings_a_dead_worker_is_evicted(buffer, start_service, engines):
    a, b = engines(), engines()
    args = [
        "router",
        "--port",
        "0",
        "--no-rollout",
        "--redis-url",
        buffer.config.redis_url,
        "--run-id",
        buffer.config.run_id,
        "--engine-urls",
        a.url,
        b.url,
    ]
    router = start_service("router", args)
    a.stop()
    # Defaults: 3 failed checks 1 s apart (each at most 2 s): well within 10 s, here 15 s max.
    wait_until(lambda: not workers_by_url(router)[a.url]["healthy"], "eviction", timeout_s=15)
    assert "health check" in workers_by_url(router)[a.url]["last_error"]


def test_an_in_flight_request_to_a_worker_that_dies_is_retried_on_another(
    buffer, start_service, engines
):
    slow, fast = engines("--delay-ms", "5000"), engines()
    # One failure evicts: the request's own lost connection takes the worker out, which must
    # not cancel the request's next attempt on the other worker.
    urls = [slow.url, fast.url]
    router = start_router(
        start_service, buffer, urls, "--policy", "round_robin", "--health-failures", "1"
    )
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: result.update(r=httpx.post(router.url + "/generate", json=GEN, timeout=30))
    )
    thread.start()
    wait_until(lambda: workers_by_url(router)[slow.url]["outstanding"] == 1, "request on slow")
    slow.stop()
    thread.join(30)
    assert result["r"].status_code == 200
    assert [o["output_ids"] for o in result["r"].json()] == [[5, 4, 2], [4, 5, 5, 5]]
    assert workers_by_url(router)[slow.url]["errors"] == 1
    assert workers_by_url(router)[fast.url]["errors"] == 0
    assert httpx.get(router.url + "/rollout/status").json()["retries"] == 1


def test_requests_waiting_on_a_hung_worker_go_to_another_once_it_is_evicted(
    buffer, start_service, engines
):
    """SIGSTOP: the engine keeps its connections open and never answers. Its waiting requests
    are asked of the other engine when the health checks evict it, not after the request
    timeout (600 s by default)."""
    hung, ok = engines("--delay-ms", "300"), engines()
    flags = ["--policy", "round_robin", "--health-failures", "2", "--health-timeout-s", "0.5"]
    router = start_router(start_service, buffer, [hung.url, ok.url], *flags)
    results: list[int] = []

    def send() -> None:
        results.append(httpx.post(router.url + "/generate", json=GEN, timeout=60).status_code)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    wait_until(lambda: workers_by_url(router)[hung.url]["outstanding"] > 0, "requests on hung")
    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for thread in threads:
            thread.join(30)
        waited = time.monotonic() - started
        assert results == [200] * 6, results
        assert waited < 10, f"waiting requests were reissued only after {waited:.1f} s"
        worker = workers_by_url(router)[hung.url]
        assert not worker["healthy"] and worker["outstanding"] == 0
        # Its last error is why it was evicted, not that cause nested once per waiting request.
        assert worker["errors"] > 0 and "taken out" not in worker["last_error"], worker
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)


def test_session_affinity_sends_a_session_to_the_same_worker(buffer, start_service, engines):
    urls = [engines().url, engines().url, engines().url]
    router = start_router(start_service, buffer, urls, "--policy", "session_affinity")
    for session in ("alice", "bob", "carol", "dave"):
        before = {u: w["requests"] for u, w in workers_by_url(router).items()}
        for _ in range(3):
            r = httpx.post(router.url + "/generate", json=GEN, headers={"X-Session-Id": session})
            assert r.status_code == 200
        after = {u: w["requests"] for u, w in workers_by_url(router).items()}
        assert sorted(after[u] - before[u] for u in urls) == [0, 0, 3]


def test_streaming_generate_is_forwarded_as_server_sent_events(buffer, start_service, engines):
    router = start_router(start_service, buffer, [engines().url])
    with httpx.stream("POST", router.url + "/generate", json={**GEN, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 3


def test_control_calls_fan_out_to_every_worker(buffer, start_service, engines):
    urls = [engines().url, engines().url]
    router = start_router(start_service, buffer, urls)
    for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/abort_request"):
        result = httpx.post(router.url + path, json={}).json()
        assert set(result) == set(urls)
        assert all(r["status"] == 200 for r in result.values())


def test_an_engine_whose_context_cannot_hold_the_response_bound_gets_no_samples_and_says_why(
    buffer, start_service, engines, toy_model_dir
):
    # the response bound is 4 tokens (router_args): a context of 4 leaves no room for a prompt
    short, fits = engines("--context-length", "4"), engines("--context-length", "64")
    args = router_args(buffer, toy_model_dir, [short.url, fits.url], "--health-interval-s", "0.2")
    router = start_service("router", args)
    wait_until(lambda: buffer.depth() >= 8, "groups from the engine that fits")
    refused = workers_by_url(router)[short.url]
    assert not refused["healthy"] and refused["requests"] == 0, refused
    expected = (
        f"engine {short.url} has a context length of 4 tokens (its /server_info), which cannot "
        "hold a response of --rollout-max-response-len 4 and a prompt: start the engine with "
        "--context-length above 4, or lower --rollout-max-response-len below 4"
    )
    assert refused["refused"] == expected and refused["last_error"] == expected
    assert f"refused {short.url}: {expected}" in router.log()
    assert httpx.get(short.url + "/server_info").json()["requests"] == 0, "no health re-admission"
    later = engines("--context-length", "3")
    reply = httpx.post(router.url + "/workers", json={"url": later.url})
    assert reply.status_code == 202 and reply.json()["status"] == "refused", reply.text
    assert "has a context length of 3 tokens" in reply.json()["refused"]
    # restarted as the refusal says, at its URL: the health checks admit it (it stayed refused
    # until registered again by hand)
    short.stop()
    port = short.url.rsplit(":", 1)[1]
    engines("--context-length", "64", "--port", port)
    wait_until(lambda: workers_by_url(router)[short.url]["healthy"], "its admission")
    for _ in range(4):  # (the rollout waits for a trainer: requests of a client)
        assert httpx.post(router.url + "/generate", json=GEN).status_code == 200
    back = workers_by_url(router)[short.url]
    assert back["requests"] > 0 and not back["refused"] and not back["last_error"], back
    assert f"{short.url} passes the admission check now: no longer refused" in router.log()


def test_a_router_whose_every_engine_context_is_too_short_exits_2_naming_the_flags(
    buffer, engines, toy_model_dir
):
    short = engines("--context-length", "4")
    args = router_args(buffer, toy_model_dir, [short.url])
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"engine {short.url} has a context length of 4 tokens" in run.stderr, run.stderr
    assert "--context-length above 4, or lower --rollout-max-response-len below 4" in run.stderr
    last = run.stderr.strip().splitlines()[-1]  # (uvicorn logs a lifespan failure's traceback)
    assert last.startswith(f"tandem router: start-up failed: engine {short.url} has a"), last
