"""Router <-> broker handshake: an engine that joins late, restarts, or misses an NCCL version
while it stays up gets no traffic until the broker has brought it to the current weight version.

Real processes throughout: reference engines with the toy model, the broker (ZMQ transport),
the router with `--broker-url`, and a trainer-side `ZmqWeightSender` pushing real weights.
"""

from __future__ import annotations

import os
import signal
import threading
from urllib.parse import urlparse

import httpx
import pytest

from services.weight_sync.nccl_sender import NcclWeightSender
from services.weight_sync.zmq_transport import ZmqWeightSender
from tests.helpers import wait_until
from tests.test_broker_nccl import perturbed_weights

pytestmark = pytest.mark.slow


def worker(router_url: str, engine_url: str) -> dict:
    workers = httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]
    return next(w for w in workers if w["url"] == engine_url)


def engine_args(model_dir, port: int = 0) -> list[str]:  # type: ignore[no-untyped-def]
    return ["engine", "--model", str(model_dir), "--port", str(port)]


@pytest.fixture
def stack(start_service, toy_model_dir, buffer):  # type: ignore[no-untyped-def]
    """An engine on version 1 behind a router that knows the broker."""
    redis = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    first = start_service("engine0", engine_args(toy_model_dir))
    broker = start_service(
        "broker",
        ["broker", "--port", "0", "--engine-urls", first.url, *redis],
    )
    router = start_service(
        "router",
        [
            "router",
            "--port",
            "0",
            "--engine-urls",
            first.url,
            "--broker-url",
            broker.url,
            "--model",
            str(toy_model_dir),
            "--no-rollout",
            "--health-interval-s",
            "0.2",
            *redis,
        ],
    )
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    tensors, _model = perturbed_weights(toy_model_dir, seed=1)
    sender.send(1, tensors)
    wait_until(lambda: worker(router.url, first.url)["weight_version"] == 1, "engine0 on v1", 60)
    yield first, broker, router
    sender.close()


def test_an_engine_added_at_run_time_is_synced_before_it_is_admitted(
    stack, start_service, toy_model_dir
) -> None:
    _first, broker, router = stack
    late = start_service("late", engine_args(toy_model_dir))
    added = httpx.post(f"{router.url}/workers", json={"url": late.url}, timeout=30).json()
    # It serves its load weights (version 0) while the pool is on version 1: pending.
    assert added["status"] == "pending" and added["healthy"] is False
    assert "waiting for version 1" in added["last_error"]
    # The router handed it to the broker, which synced it; then the router admitted it.
    admitted = wait_until(
        lambda: (w := worker(router.url, late.url))["healthy"] and w, "admission", 60
    )
    assert admitted["weight_version"] == 1
    engines = {e["url"]: e for e in httpx.get(f"{broker.url}/state").json()["engines"]}
    assert engines[late.url]["version"] == 1
    assert httpx.get(f"{late.url}/get_weight_version").json()["weight_version"] == "1"


def test_a_restarted_engine_gets_no_traffic_until_it_is_back_on_the_current_version(
    stack, start_service, toy_model_dir
) -> None:
    first, broker, router = stack
    second = start_service("engine1", engine_args(toy_model_dir))
    httpx.post(f"{router.url}/workers", json={"url": second.url}, timeout=30)
    wait_until(lambda: worker(router.url, second.url)["healthy"], "engine1 admitted", 60)

    versions: list[str] = []
    stop = threading.Event()

    def generate() -> None:  # steady traffic through the router during the restart
        body = {"input_ids": [1, 7, 11, 14], "sampling_params": {"max_new_tokens": 2}}
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                reply = client.post(f"{router.url}/generate", json=body)
                if reply.status_code == 200:
                    versions.append(reply.json()["meta_info"]["weight_version"])

    traffic = threading.Thread(target=generate)
    traffic.start()
    try:
        port = urlparse(first.url).port
        first.stop()
        restarted = start_service("engine0-again", engine_args(toy_model_dir, port))
        assert restarted.url == first.url
        # Out while it serves version 0 (the router saw its version go down, or its checks
        # failed while it was down), back once the broker re-synced it.
        wait_until(
            lambda: (w := worker(router.url, first.url))["healthy"] and w["weight_version"] == 1,
            "engine0 re-admitted on version 1",
            60,
        )
        served_before = len(versions)
        wait_until(lambda: len(versions) > served_before + 20, "traffic after re-admission", 60)
    finally:
        stop.set()
        traffic.join()
    assert versions and set(versions) == {"1"}, "a response came from version-0 weights"
    engines = {e["url"]: e for e in httpx.get(f"{broker.url}/state").json()["engines"]}
    assert engines[first.url]["version"] == 1


def test_an_engine_whose_nccl_update_failed_is_taken_out_and_rejoins_at_the_next_version(
    start_service, toy_model_dir, buffer
) -> None:
    """An engine hangs through one NCCL broadcast but stays up for the router: the broker leaves
    it out of its weight group. The router sees it lag the pool's version, takes it out and
    hands it back to the broker, whose next version includes it again."""
    redis = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    engines = [
        start_service(f"engine{i}", [*engine_args(toy_model_dir), "--update-timeout-s", "20"])
        for i in range(2)
    ]
    urls = [e.url for e in engines]
    flags = ["--transport", "nccl", "--sync-timeout-s", "6", "--engine-urls", *urls]
    broker = start_service("broker", ["broker", "--port", "0", *flags, *redis])
    router_flags = ["--health-interval-s", "0.2", "--health-failures", "1000"]  # never evicts
    router_flags += ["--engine-urls", *urls, "--broker-url", broker.url, "--no-rollout"]
    router_flags += ["--broker-retry-s", "4"]
    router = start_service(
        "router", ["router", "--port", "0", "--model", str(toy_model_dir), *router_flags, *redis]
    )
    sender = NcclWeightSender(broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=30)
    try:
        sender.send(1, perturbed_weights(toy_model_dir, seed=1)[0])
        healthy, victim = engines
        wait_until(lambda: worker(router.url, victim.url)["weight_version"] == 1, "v1", 30)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            sender.send(2, perturbed_weights(toy_model_dir, seed=2)[0])  # goes on without it
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        state = {e["url"]: e for e in httpx.get(f"{broker.url}/state").json()["engines"]}
        assert state[victim.url]["in_rotation"] is False and state[victim.url]["version"] == 1
        assert worker(router.url, victim.url)["healthy"], "the router never saw it fail"
        # Behind the pool (version 2) for --broker-retry-s: out, and registered with the broker.
        wait_until(lambda: not worker(router.url, victim.url)["healthy"], "victim out", 60)
        assert "waiting for version 2" in worker(router.url, victim.url)["last_error"]

        def registered_again() -> bool:  # (its retry no longer waits for a registration; it
            # stays out of rotation, out of the gate, until it takes the newest version)
            engines = httpx.get(f"{broker.url}/state").json()["engines"]
            return any(e["url"] == victim.url and e["retry_at"] is not None for e in engines)

        wait_until(registered_again, "the victim registered with the broker again", 30)
        sender.send(3, perturbed_weights(toy_model_dir, seed=3)[0])
        wait_until(
            lambda: (w := worker(router.url, victim.url))["healthy"] and w["weight_version"] == 3,
            "the victim re-admitted on version 3",
            30,
        )
        # (the router learns the other engine's version at its next health check: once, under
        # CI load, it still said 2 here)
        wait_until(lambda: worker(router.url, healthy.url)["weight_version"] == 3, "v3", 30)
    finally:
        sender.close()


def test_an_engine_that_died_since_its_group_formed_is_left_out_before_the_broadcast(
    start_service, toy_model_dir, buffer
) -> None:
    """Seen on 4 H200s: an engine killed between two versions, before the router reported it,
    was still in the broker's weight group; the trainer's broadcast to it hung until NCCL's
    watchdog ended the trainer. The broker now asks every member to answer before a broadcast:
    the dead one is out of rotation and the version goes to the others in a fresh group."""
    redis = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    engines = [start_service(f"engine{i}", engine_args(toy_model_dir)) for i in range(2)]
    urls = [e.url for e in engines]
    flags = ["--transport", "nccl", "--sync-timeout-s", "20", "--engine-urls", *urls]
    broker = start_service("broker", ["broker", "--port", "0", *flags, *redis])
    sender = NcclWeightSender(broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=60)
    try:
        sender.send(1, perturbed_weights(toy_model_dir, seed=1)[0])
        alive, victim = engines
        victim.proc.kill()
        victim.proc.wait()
        sender.send(2, perturbed_weights(toy_model_dir, seed=2)[0])
    finally:
        sender.close()
    state = {e["url"]: e for e in httpx.get(f"{broker.url}/state").json()["engines"]}
    assert state[alive.url]["version"] == 2 and state[alive.url]["in_rotation"]
    assert not state[victim.url]["in_rotation"] and state[victim.url]["version"] == 1
    assert (
        "did not answer GET /model_info before the broadcast" in (state[victim.url]["last_error"])
    ), state[victim.url]
