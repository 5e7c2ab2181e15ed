"""Bounded fuzzing of every operation each service publishes (schemathesis over its OpenAPI):
no request the schema allows, or nearly allows, gets a 500 or kills the service.

The engine, the router (agent sessions on, rollout off) and the broker run as subprocesses on
loopback, with the run's token sent so that mutating routes are exercised past the auth check.
Each operation gets a few derandomized examples (reproducible) that fit its schema and a few
that break it (wrong types, missing fields: a 4xx, never a 500); each service has a wall-time
budget. 502/503/504 are allowed: they are the gateway answers for an upstream that is down or
slow (an engine URL a fuzzed body made up, a rendezvous nobody hosts), each with its reason.
Excluded: routes that would stop generation for the rest of the test (pause, releasing memory,
starting the rollout loop). Bodies no schema describes are sent to every operation that takes
one, without a content type (FastAPI then parses them as JSON): bytes that are no UTF-8 text
(a 500 on the router's and broker's routes until FastAPI's answer to them was fixed), bad JSON,
nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from services.sample_buffer import SampleBuffer
from tests.helpers import with_chat_template

TOKEN = "fuzz-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "fuzz"}
GATEWAY = {502, 503, 504}
SKIP = {"/pause_generation", "/release_memory_occupation", "/rollout/start", "/rollout/resume"}
RAW_BODIES = (b"\xff\xfe{", b'{"a": ', b"")


def fuzz(url: str, budget_s: float, examples: int = 6) -> list[str]:
    """Problems found: '<METHOD> <path> -> <status>: <body>' (empty: none)."""
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), f"{url}: duplicate operationIds {sorted(ids)}"
    schema = schemathesis.openapi.from_dict(spec)
    deadline = time.monotonic() + budget_s
    problems: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in SKIP:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(op, mode, url, examples, deadline, problems)
    problems += raw_problems(url, spec)
    assert httpx.get(url + "/health", timeout=10).status_code == 200, "the service died"
    return problems


def raw_problems(url: str, spec: dict[str, Any]) -> list[str]:
    """`RAW_BODIES` to each operation that takes a body: '<METHOD> <path> -> <status>: ...'."""
    problems = []
    for path, item in spec["paths"].items():
        for method in set(item) & {"post", "put", "patch"}:
            if path in SKIP:
                continue
            for body in RAW_BODIES:
                reply = httpx.request(
                    method,
                    url + path.replace("{", "").replace("}", ""),
                    content=body,
                    headers=HEADERS,
                    timeout=30,
                )
                if reply.status_code >= 500 and reply.status_code not in GATEWAY:
                    problems.append(f"{method.upper()} {path} {body!r} -> {reply.status_code}")
    return problems


def fuzz_operation(
    op: Any, mode: GenerationMode, url: str, examples: int, deadline: float, problems: list[str]
) -> None:
    """`examples` requests that fit the schema (positive) or break it (negative)."""
    name = f"{op.method.upper()} {op.path} ({mode.value})"

    @settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def call(case: Any) -> None:
        if time.monotonic() > deadline:
            return
        try:
            reply = case.call(base_url=url, headers=HEADERS, timeout=30)
        except Exception as exc:  # a dropped connection is a finding too
            problems.append(f"{name} -> {exc!r}: {case.body!r:.200}")
            return
        if reply.status_code >= 500 and reply.status_code not in GATEWAY:
            problems.append(f"{name} -> {reply.status_code}: {reply.text[:300]}")

    try:
        call()
    except Unsatisfiable:  # an operation without inputs has nothing to break
        assert mode is GenerationMode.NEGATIVE, name


@pytest.fixture
def services(start_service, buffer: SampleBuffer, toy_model_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    model = with_chat_template(
        toy_model_dir,
        tmp_path / "chat",
        "<bos>{% for m in messages %}{{ m['content'] }}>{% endfor %}",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_API_TOKEN", TOKEN)
        engine = start_service(
            "engine", ["engine", "--model", str(model), "--port", "0", "--update-timeout-s", "1"]
        )
        broker = start_service("broker", ["broker", "--port", "0", "--sync-timeout-s", "2"])
        args = ["router", "--port", "0", "--engine-urls", engine.url, "--model", str(model)]
        args += ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
        args += ["--no-rollout", "--health-timeout-s", "0.5"]
        router = start_service("router", args)
    return {"engine": engine.url, "router": router.url, "broker": broker.url}


@pytest.mark.slow
def test_no_fuzzed_request_gets_a_500_from_any_service(services: dict[str, str]) -> None:
    # TANDEM_FUZZ_SCALE=10 fuzzes ten times longer (a deeper search outside CI)
    scale = float(os.environ.get("TANDEM_FUZZ_SCALE", "1"))
    problems = []
    for name, budget_s in (("broker", 20), ("engine", 60), ("router", 60)):
        found = fuzz(services[name], budget_s * scale, examples=round(6 * scale))
        problems += [f"{name}: {p}" for p in found]
    assert problems == [], "\n".join(problems)
