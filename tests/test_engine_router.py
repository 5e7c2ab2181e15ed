"""Compatibility with the real Rust `sglang-router`: it registers two engines, sees them healthy
and routes `/generate` to both (round robin). Marked slow: the router takes seconds to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def router_for(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(worker_urls: list[str]) -> str:
        port, metrics_port = free_port(), free_port()
        log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--worker-urls",
                    *worker_urls,
                    "--policy",
                    "round_robin",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(metrics_port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def wait_ready(router: str, workers: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = httpx.get(f"{router}/readiness", timeout=5).json()
            if state.get("healthy_workers") == workers:
                return state
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"router at {router} never saw {workers} healthy workers")


def test_sglang_router_registers_both_engines_and_routes_generate_to_each(
    start_service, router_for, toy_model_dir: Path
) -> None:
    engines = [
        start_service(f"engine{i}", ["engine", "--model", str(toy_model_dir), "--port", "0"])
        for i in range(2)
    ]
    router = router_for([e.url for e in engines])
    wait_ready(router, 2)
    workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(e.url for e in engines)
    assert all(w["is_healthy"] for w in workers)
    assert all(w["model_id"] == str(toy_model_dir) for w in workers)

    for i in range(6):
        out = httpx.post(
            f"{router}/generate",
            timeout=60,
            json={
                "input_ids": [1, 4 + i, 14],
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True},
            },
        ).json()
        assert len(out["output_ids"]) == 3
        assert out["meta_info"]["weight_version"] == "0"
        assert len(out["meta_info"]["output_token_logprobs"]) == 3

    served = [
        httpx.get(f"{e.url}/get_server_info").json()["internal_states"][0]["generated_tokens"]
        for e in engines
    ]
    assert all(tokens > 0 for tokens in served), served
    assert sum(served) == 18
