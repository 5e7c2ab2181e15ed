"""Engines synced independently: the broker as a process, a real trainer-side sender, real HTTP
engines (tests/fake_engine.py) and a real Valkey server. One engine stopped with SIGSTOP (a hung
GPU or host) mid-run is left behind, its sync bounded by `--sync-timeout-s`; the others take
every later version meanwhile; once another engine takes a version newer than the one it syncs,
it is out of rotation (left behind) and `version:engines` follows the engines that serve; the
stopped one, resumed, catches up to the newest version and is back in rotation. The broker also
says what an operator must see: that it has no engine left, and that its weight intake is
unsigned without TANDEM_WEIGHT_SECRET."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from services.sample_buffer import SampleBuffer
from services.weight_sync.zmq_transport import ZmqWeightSender
from tests.helpers import wait_until
from tests.test_broker_sync import expected_sums, weights

FAKE_ENGINE = str(Path(__file__).with_name("fake_engine.py"))


@pytest.fixture
def fake_engine(start_service):
    def _start(name: str, *flags: str):
        return start_service(name, list(flags), program=[sys.executable, FAKE_ENGINE])

    return _start


def engine_version(url: str) -> str:
    return httpx.get(f"{url}/checksums", timeout=5).json()["version"]


def test_an_engine_stopped_mid_run_holds_back_no_other_engine_and_catches_up_when_resumed(
    start_service, fake_engine, buffer: SampleBuffer
) -> None:
    good, stopped = fake_engine("good"), fake_engine("stopped")
    broker = start_service(
        "broker",
        [
            "broker",
            "--port",
            "0",
            "--redis-url",
            buffer.config.redis_url,
            "--run-id",
            buffer.config.run_id,
            "--engine-urls",
            good.url,
            stopped.url,
            "--sync-timeout-s",
            "120",  # longer than every wait below: only the per-engine sync lets them pass
        ],
    )
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    sender.send(1, weights(1))
    wait_until(lambda: buffer.get_version("engines") == 1, "both engines on version 1")
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    try:
        for step in (2, 3, 4):
            sender.send(step, weights(step))
            wait_until(lambda s=step: engine_version(good.url) == str(s), f"good on {step}")
        # The stopped engine, still syncing version 2 once the good one took 3, is left behind:
        # out of rotation, so `version:engines` (the gate) follows the engine that serves.
        wait_until(lambda: buffer.get_version("engines") == 4, "version:engines 4", timeout_s=20)
        state = httpx.get(f"{broker.url}/state").json()
        by_url = {e["url"]: e for e in state["engines"]}
        assert by_url[good.url]["version"] == 4 and by_url[good.url]["in_rotation"] is True
        left = by_url[stopped.url]
        assert (left["version"], left["syncing"], left["in_rotation"]) == (1, True, False)
        assert "left behind: still syncing version 2" in left["last_error"]
        assert f"{stopped.url} serves 1 (syncing)" in state["waiting_for"]
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    # Resumed, it ends the sync it was stopped in (version 2 is no longer held: it fails and
    # is retried after the backoff) and is brought to the newest version.
    wait_until(lambda: engine_version(stopped.url) == "4", "the resumed engine on 4", timeout_s=60)
    assert httpx.get(f"{stopped.url}/checksums").json()["sums"] == expected_sums(4)
    wait_until(
        lambda: all(
            e["version"] == 4 and e["in_rotation"]
            for e in httpx.get(f"{broker.url}/state").json()["engines"]
        ),
        "the broker to record the resumed engine on 4, in rotation",
    )
    assert buffer.get_version("engines") == 4
    sender.close()


def test_a_broker_whose_every_engine_was_removed_says_it_has_none(
    start_service, fake_engine, buffer: SampleBuffer
) -> None:
    engine = fake_engine("e")
    redis = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    broker = start_service("broker", ["broker", "--port", "0", *redis, "--engine-urls", engine.url])
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    sender.send(1, weights(1))
    wait_until(lambda: buffer.get_version("engines") == 1, "the engine on version 1")
    httpx.delete(f"{broker.url}/engines", params={"url": engine.url}).raise_for_status()
    said = "an engine to sync: none is registered"
    assert said in httpx.get(f"{broker.url}/state").json()["waiting_for"]

    def recorded() -> bool:
        status = buffer.statuses().get("broker")
        return status is not None and said in status.waiting_for and status.state == "waiting"

    wait_until(recorded, "the broker's status (the watchdog reads it) to say it has no engine")
    sender.close()


def test_a_broker_without_the_weight_secret_warns_at_start_and_on_health(
    start_service, monkeypatch: pytest.MonkeyPatch
) -> None:
    unsigned = start_service("unsigned", ["broker", "--port", "0"])
    warning = httpx.get(f"{unsigned.url}/health").json()["warning"]
    assert "TANDEM_WEIGHT_SECRET is not set" in warning and "unsigned" in warning
    assert "TANDEM_WEIGHT_SECRET is not set" in unsigned.log()
    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "s3cret")
    signed = start_service("signed", ["broker", "--port", "0"])
    assert "warning" not in httpx.get(f"{signed.url}/health").json()
    assert "TANDEM_WEIGHT_SECRET is not set" not in signed.log()
