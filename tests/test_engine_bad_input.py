"""A bad request to the reference engine is a 4xx naming the field, never a 500 or a hang; its
mutating routes need the run's token; its OpenAPI schema publishes every body."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

TOKEN = "engine-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def engine(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from conftest import ServiceProcess

    args = ["engine", "--model", str(toy_model_dir), "--port", "0"]
    args += ["--update-timeout-s", "3", "--max-request-bytes", "65536"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_API_TOKEN", TOKEN)
        service = ServiceProcess(args, tmp_path_factory.mktemp("engine"), "engine")
    yield service.url
    service.stop()


def post(url: str, body: object, auth: bool = True, timeout: float = 30) -> httpx.Response:
    return httpx.post(url, json=body, headers=AUTH if auth else {}, timeout=timeout)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/get_weights_by_name", {"name": {}}, "name"),
        ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 0}, "truncate_size"),
        ("/update_weights_from_zmq", {"endpoint": "garbage", "weight_version": "1"}, "endpoint"),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "world_size": 0},
            "world_size",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "x", "master_port": 1, "world_size": 2, "rank_offset": 2},
            "rank_offset",
        ),
        ("/update_weights_from_disk", {"model_path": 3}, "model_path"),
        ("/update_weights_from_distributed", {"names": "a"}, "names"),
        ("/pause_generation", {"mode": "sometimes"}, "mode"),
        ("/abort_request", {"rid": 5}, "rid"),
        ("/update_weight_version", {"new_version": None}, "new_version"),
        ("/update_weights_from_disk", [1, 2], "body"),
    ],
)
def test_a_malformed_body_is_a_400_naming_the_field(engine: str, path: str, body, field) -> None:  # type: ignore[no-untyped-def]
    reply = post(engine + path, body)
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["message"]


def test_a_silent_broker_endpoint_answers_504_naming_the_request_timeout(engine: str) -> None:
    body = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "weight_version": "1", "timeout_s": 0.5}
    reply = post(engine + "/update_weights_from_zmq", body)
    assert reply.status_code == 504
    assert "0.5s" in reply.json()["message"] and "timeout_s" in reply.json()["message"]


def test_a_rendezvous_nobody_hosts_ends_within_the_timeout_and_blocks_nothing(
    engine: str, toy_model_dir: Path
) -> None:
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    body["backend"] = "gloo"
    reply = post(engine + "/init_weights_update_group", body, timeout=60)
    assert reply.status_code == 504, reply.text
    assert "rendezvous" in reply.json()["message"]
    # the bound it waited is named: 0.75 of --update-timeout-s 3 (it said 3, the wrong number)
    assert "waited 2.25s: 0.75 of --update-timeout-s 3" in reply.json()["message"], reply.text
    # the weight thread is free again: the next weight command is served, not queued
    started = time.monotonic()
    body = {"model_path": str(toy_model_dir), "weight_version": "7"}
    reply = post(engine + "/update_weights_from_disk", body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - started < 30, "queued behind the failed rendezvous"


def test_a_body_over_max_request_bytes_is_413_before_it_is_read(engine: str) -> None:
    reply = post(engine + "/generate", {"input_ids": [1] * 40000})
    assert reply.status_code == 413 and "--max-request-bytes" in reply.text
    chunks = iter([b'{"input_ids": [', b"1," * 40000, b"1]}"])
    reply = httpx.post(engine + "/generate", content=chunks, timeout=30)  # chunked, no length
    assert reply.status_code == 413


def test_mutating_routes_need_the_token_and_reads_stay_open(engine: str) -> None:
    body = {"new_version": "9", "abort_all_requests": False}
    assert post(engine + "/update_weight_version", body, auth=False).status_code == 401
    assert post(engine + "/pause_generation", {}, auth=False).status_code == 401
    disk = {"model_path": "/nonexistent", "weight_version": "38"}
    assert post(engine + "/update_weights_from_disk", disk, auth=False).status_code == 401
    assert httpx.post(engine + "/flush_cache").status_code == 401
    assert httpx.get(engine + "/flush_cache").status_code == 401
    assert httpx.post(engine + "/flush_cache", headers=AUTH).status_code == 200
    assert post(engine + "/update_weight_version", body).status_code == 200
    assert httpx.get(engine + "/model_info").json()["weight_version"] == "9"
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(engine + "/abort_request", json={}, headers=wrong).status_code == 401


def test_the_openapi_schema_has_unique_ids_and_a_body_for_every_weight_route(engine: str) -> None:
    spec = httpx.get(engine + "/openapi.json").json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path, item in spec["paths"].items():
        post_op = item.get("post")
        if post_op is None or path in {"/flush_cache"}:
            continue
        assert "requestBody" in post_op, f"POST {path} publishes no request body"
    generate = spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert "input_ids" in generate["schema"]["properties"]


def test_a_service_without_a_token_refuses_a_public_address(toy_model_dir: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_TOKEN"}
    args = ["engine", "--model", str(toy_model_dir), "--host", "0.0.0.0", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "TANDEM_API_TOKEN" in done.stderr


# (SIGHUP: a closed terminal; SIGINT: Ctrl-C, which ended it with a traceback)
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_sigterm_ends_requests_held_by_a_pause_with_an_abort_reason_and_exits_0(
    start_service, toy_model_dir: Path, number: int
) -> None:  # type: ignore[no-untyped-def]
    """Exit 0, as the exit-code table has it: the engine died of the SIGTERM it had handled."""
    import concurrent.futures

    service = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    assert httpx.post(service.url + "/pause_generation", json={"mode": "in_place"}).is_success
    body = {"input_ids": [1, 5, 14], "sampling_params": {"max_new_tokens": 4}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, service.url + "/generate", json=body, timeout=60)
        time.sleep(0.5)  # the request is waiting on the pause (nothing else would end it)
        assert not held.done()
        os.kill(service.proc.pid, number)
        reply = held.result(timeout=60)
    assert reply.status_code == 200
    reason = reply.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "shutting down" in reason["message"]
    assert service.proc.wait(timeout=30) == 0
    assert "Traceback" not in service.log()


def test_health_is_503_once_the_generation_thread_is_gone(toy_model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from services.engine.config import EngineConfig
    from services.engine.server import create_app

    app = create_app(EngineConfig(model=str(toy_model_dir)))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.engine.scheduler.stop()
        reply = client.get("/health")
        assert reply.status_code == 503 and "generation thread" in reply.text
