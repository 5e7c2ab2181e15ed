"""The weight broker as a process, with a real trainer-side sender and real HTTP engines.

The engines are stand-ins at the far edge (`tests/fake_engine.py`: real HTTP server, real ZMQ
fetch through `fetch_weights`, no model), so each arrow of the broker's ordering contract can
be observed: version pushed -> complete -> every engine fetched it -> Redis version updated.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from services.weight_sync.zmq_transport import BrokerGoneError, ZmqWeightSender, fetch_weights
from tests.helpers import wait_until

FAKE_ENGINE = str(Path(__file__).with_name("fake_engine.py"))


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed_tokens.weight", torch.full((16, 8), float(step))),
        (
            "model.layers.0.self_attn.q_proj.weight",
            torch.full((8, 8), 2.0 * step, dtype=torch.bfloat16),
        ),
        ("lm_head.weight", torch.arange(128, dtype=torch.float32).reshape(16, 8) + step),
    ]


def expected_sums(step: int) -> dict[str, float]:
    return {name: float(t.double().sum()) for name, t in weights(step)}


@pytest.fixture
def fake_engine(start_service):
    """`fake_engine(name, *flags)`: a stand-in engine process (see tests/fake_engine.py)."""

    def _start(name: str, *flags: str):
        return start_service(name, list(flags), program=[sys.executable, FAKE_ENGINE])

    return _start


def test_every_engine_gets_each_version_and_redis_reports_it(
    start_service, fake_engine, buffer: SampleBuffer
) -> None:
    engines = [fake_engine("e1"), fake_engine("e2")]
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
            *[e.url for e in engines],
        ],
    )
    # The broker probes no engine (the router owns their versions): before the first version
    # it has synced none, so it publishes none.
    assert httpx.get(f"{broker.url}/state").json()["version"] == -1
    assert buffer.get_version("engines") == -1

    sender = ZmqWeightSender(broker.info["intake_endpoint"], bucket_bytes=600)
    for step in (1, 2):
        sent = sender.send(step, weights(step))
        assert sent == sum(t.numel() * t.element_size() for _, t in weights(step))
        wait_until(lambda s=step: buffer.get_version("engines") == s, f"engines on {step}")
        for engine in engines:
            got = httpx.get(f"{engine.url}/checksums").json()
            assert got["version"] == str(step)
            assert got["sums"] == expected_sums(step)

    state = httpx.get(f"{broker.url}/state").json()
    assert state["version"] == 2
    assert all(e["version"] == 2 and e["in_rotation"] for e in state["engines"])
    assert all(e["last_bytes_per_s"] > 0 for e in state["engines"])
    metrics = httpx.get(f"{broker.url}/metrics").text
    assert "tandem_broker_version 2" in metrics

    # Every engine is on the newest version: what the broker waits for is the trainer.
    def waits_for_the_trainer() -> bool:
        status = buffer.statuses().get("broker")
        return status is not None and "trainer's next weight version" in status.waiting_for

    wait_until(waits_for_the_trainer, "the broker's status to name the trainer", timeout_s=10)
    assert "trainer's next weight version" in httpx.get(f"{broker.url}/state").json()["waiting_for"]
    sender.close()


def test_a_broker_whose_transport_contradicts_the_trainers_is_refused(
    buffer: SampleBuffer,
) -> None:
    import subprocess

    from proto.contract import RunContract

    buffer.agree_contract(RunContract(weight_transport="nccl"), "trainer")
    flags = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "broker", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "'nccl'" in result.stderr and "'zmq'" in result.stderr
    assert "--weight-transport" in result.stderr


def test_on_one_host_the_payload_travels_through_shared_memory(
    start_service, fake_engine, buffer: SampleBuffer, tmp_path
) -> None:
    engines = [fake_engine("s1"), fake_engine("s2")]
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
            *[e.url for e in engines],
        ],
    )
    shm = tmp_path / "shm"
    shm.mkdir()
    sender = ZmqWeightSender(broker.info["intake_endpoint"], shm_dir=str(shm))
    for step in (1, 2, 3):
        assert sender.send(step, weights(step)) == sum(
            t.numel() * t.element_size() for _, t in weights(step)
        )
        wait_until(lambda s=step: buffer.get_version("engines") == s, f"engines on {step}")
        for engine in engines:
            assert httpx.get(f"{engine.url}/checksums").json()["sums"] == expected_sums(step)
    # Two slot files, double-buffered, private to the trainer's user.
    files = sorted(shm.iterdir())
    assert [f.name.rsplit("-", 1)[1] for f in files] == ["slot0", "slot1"]
    assert all(f.stat().st_mode & 0o077 == 0 for f in files)
    sender.close(linger_s=0)
    assert list(shm.iterdir()) == []


def test_a_failing_engine_is_taken_out_and_the_others_still_advance(
    start_service, fake_engine, buffer: SampleBuffer
) -> None:
    good = fake_engine("good")
    bad = fake_engine("bad", "--fail")
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
            bad.url,
        ],
    )
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    sender.send(1, weights(1))
    wait_until(lambda: buffer.get_version("engines") == 1, "good engine on version 1")
    state = httpx.get(f"{broker.url}/state").json()
    by_url = {e["url"]: e for e in state["engines"]}
    assert by_url[good.url]["version"] == 1
    assert by_url[bad.url]["in_rotation"] is False
    assert "told to fail" in by_url[bad.url]["last_error"]
    sender.close()


def test_a_hung_engine_is_timed_out_and_reported(start_service, fake_engine, buffer) -> None:
    hung = fake_engine("hung", "--hang-s", "30")
    broker = start_service(
        "broker",
        [
            "broker",
            "--port",
            "0",
            "--engine-urls",
            hung.url,
            "--sync-timeout-s",
            "1",
        ],
    )
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    sender.send(1, weights(1))

    def out_of_rotation():
        engines = httpx.get(f"{broker.url}/state").json()["engines"]
        return engines[0]["in_rotation"] is False and engines[0]["last_error"]

    error = wait_until(out_of_rotation, "hung engine taken out", timeout_s=15)
    assert "version 1" in error
    sender.close()
    hung.proc.kill()  # its hung request would hold a graceful stop for 10 s
    hung.proc.wait()


def test_a_late_engine_is_brought_to_the_current_version(
    start_service, fake_engine, buffer
) -> None:
    broker = start_service("broker", ["broker", "--port", "0"])
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    sender.send(3, weights(3))
    wait_until(lambda: httpx.get(f"{broker.url}/state").json()["version"] == 3, "version 3")
    late = fake_engine("late")
    httpx.post(f"{broker.url}/engines", json={"url": late.url}).raise_for_status()
    wait_until(lambda: httpx.get(f"{late.url}/checksums").json()["version"] == "3", "late on 3")
    assert httpx.get(f"{late.url}/checksums").json()["sums"] == expected_sums(3)
    sender.close()


def test_a_version_the_trainer_did_not_publish_is_refused_and_its_next_one_delivered(
    start_service, fake_engine, buffer: SampleBuffer
) -> None:
    engine = fake_engine("e")
    redis = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    broker = start_service("broker", ["broker", "--port", "0", "--engine-urls", engine.url, *redis])
    buffer.set_version("trainer", 1)  # the trainer announced version 1: it may send 2 next
    # A broker (re)started after the trainer sent version 1 says it never got it (its Redis
    # loop reads the announced version every 2 s).
    missing = "weight version 1, which the trainer announced but this broker has not"
    wait_until(
        lambda: missing in httpx.get(f"{broker.url}/state").json()["waiting_for"],
        "the announced version missing",
        timeout_s=5,
    )
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    sender.send(7, weights(7))
    wait_until(
        lambda: httpx.get(f"{broker.url}/state").json()["counters"]["versions_refused"] == 1,
        "version 7 refused",
    )
    assert httpx.get(f"{engine.url}/checksums").json()["version"] == "0", "7 never delivered"
    sender.send(2, weights(2))  # the trainer's real next version still gets through
    wait_until(lambda: httpx.get(f"{engine.url}/checksums").json()["version"] == "2", "on 2")
    assert httpx.get(f"{engine.url}/checksums").json()["sums"] == expected_sums(2)
    state = httpx.get(f"{broker.url}/state").json()
    assert state["version"] == 2 and state["counters"]["versions_refused"] == 1
    sender.close()


def test_a_bucket_with_a_bad_hmac_is_dropped_and_counted(
    start_service, fake_engine, monkeypatch
) -> None:
    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "right-secret")
    engine = fake_engine("e")
    broker = start_service("broker", ["broker", "--port", "0", "--engine-urls", engine.url])
    forged = ZmqWeightSender(broker.info["intake_endpoint"], secret=b"wrong-secret")
    forged.send(1, weights(1))
    unsigned = ZmqWeightSender(broker.info["intake_endpoint"], secret=None)
    unsigned.send(1, weights(1))
    wait_until(
        lambda: httpx.get(f"{broker.url}/state").json()["counters"]["buckets_rejected"] == 2,
        "both forged buckets rejected",
    )
    signed = ZmqWeightSender(broker.info["intake_endpoint"], secret=b"right-secret")
    signed.send(1, weights(1))
    wait_until(lambda: httpx.get(f"{engine.url}/checksums").json()["version"] == "1", "signed")
    for s in (forged, unsigned, signed):
        s.close()


def test_a_broker_whose_secret_differs_from_the_trainers_says_its_buckets_fail_the_hmac(
    start_service, fake_engine, buffer: SampleBuffer, monkeypatch
) -> None:
    """A trainer with another TANDEM_WEIGHT_SECRET: the broker's status (its console, /state
    and Redis) guessed the broker had started after the trainer sent the version."""
    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "broker-secret")
    engine = fake_engine("e")
    redis = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    broker = start_service("broker", ["broker", "--port", "0", "--engine-urls", engine.url, *redis])
    forged = ZmqWeightSender(broker.info["intake_endpoint"], secret=b"trainer-secret")
    forged.send(1, weights(1))
    buffer.set_version("trainer", 1)  # announced after sending, as the trainer does
    wait_until(
        lambda: "not received" in httpx.get(f"{broker.url}/state").json()["waiting_for"],
        "the announced version missing",
    )
    waiting = httpx.get(f"{broker.url}/state").json()["waiting_for"]
    assert "failed its HMAC check" in waiting and "TANDEM_WEIGHT_SECRET" in waiting, waiting
    assert "started after the trainer" not in waiting
    forged.close()


def test_the_disk_transport_writes_a_loadable_hf_directory_once_per_version(
    start_service, fake_engine, toy_model_dir, tmp_path
) -> None:
    engines = [fake_engine("d1"), fake_engine("d2")]
    disk = tmp_path / "versions"
    broker = start_service(
        "broker",
        [
            "broker",
            "--port",
            "0",
            "--transport",
            "disk",
            "--disk-dir",
            str(disk),
            "--model-dir",
            str(toy_model_dir),
            "--keep-versions",
            "1",
            "--engine-urls",
            *[e.url for e in engines],
        ],
    )
    sender = ZmqWeightSender(broker.info["intake_endpoint"])
    for step in (1, 2):
        sender.send(step, weights(step))
        for engine in engines:
            wait_until(
                lambda e=engine, s=step: (
                    httpx.get(f"{e.url}/checksums").json()["version"] == str(s)
                ),
                f"{engine.url} on {step}",
            )
            assert httpx.get(f"{engine.url}/checksums").json()["sums"] == expected_sums(step)
    # The tokenizer and config travel with the weights; older version dirs are cleaned up.
    assert (disk / "v2" / "tokenizer.json").exists()
    assert (disk / "v2" / "config.json").exists()
    assert not (disk / "v1").exists()
    sender.close()


def test_the_disk_transport_without_a_model_dir_is_refused_naming_the_flag(tmp_path) -> None:
    import subprocess

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "broker",
            "--port",
            "0",
            "--transport",
            "disk",
            "--disk-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--model-dir" in result.stderr


KILLED_BROKER = """
import os, signal, sys, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.bind("tcp://127.0.0.1:*")
print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
sock.recv_multipart()  # the engine's request for a version: killed before answering
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_fetch_from_a_broker_killed_mid_request_ends_at_once_not_at_its_timeout() -> None:
    # An engine that waited its whole timeout here held its weight lock that long, and the
    # restarted broker's first update to it timed out behind it.
    broker = subprocess.Popen(
        [sys.executable, "-c", KILLED_BROKER], stdout=subprocess.PIPE, text=True
    )
    assert broker.stdout is not None
    endpoint = broker.stdout.readline().strip()
    started = time.monotonic()
    with pytest.raises(BrokerGoneError, match="closed the connection while sending version 3"):
        fetch_weights(endpoint, 3, timeout_s=60)
    assert time.monotonic() - started < 10
    assert broker.wait(timeout=10) == -9


def test_a_redis_that_stops_answering_delays_no_sync_and_no_health_answer(
    start_service, fake_engine, tmp_path: Path
) -> None:
    engine = fake_engine("e")
    with RedisServer(log_dir=tmp_path / "redis") as server:
        buffer = SampleBuffer(BufferConfig(redis_url=server.url, run_id="paused"))
        redis = ["--redis-url", server.url, "--run-id", "paused", "--redis-call-timeout-s", "2"]
        argv = ["broker", "--port", "0", "--engine-urls", engine.url, *redis]
        broker = start_service("broker", argv)
        sender = ZmqWeightSender(broker.info["intake_endpoint"])
        sender.send(1, weights(1))
        wait_until(lambda: buffer.get_version("engines") == 1, "version:engines 1")
        server.process.send_signal(signal.SIGSTOP)  # a paused host: connections hang
        try:
            time.sleep(2.5)  # the status loop is mid-call
            sender.send(2, weights(2))
            started = time.monotonic()
            for _ in range(10):  # on its event loop Redis would hold each answer forever
                assert httpx.get(f"{broker.url}/health", timeout=1.0).status_code == 200
                assert httpx.get(f"{broker.url}/state", timeout=1.0).json()["engines"]
                time.sleep(0.2)
            wait_until(
                lambda: httpx.get(f"{engine.url}/checksums").json()["version"] == "2",
                "the engine on version 2 while Redis is paused",
                timeout_s=10,
            )
            print(f"version 2 delivered {time.monotonic() - started:.1f} s after it was sent")
        finally:
            server.process.send_signal(signal.SIGCONT)
        wait_until(lambda: buffer.get_version("engines") == 2, "version:engines 2 once resumed")
        assert httpx.get(f"{broker.url}/health").status_code == 200
        sender.close()


def test_one_broker_per_run_a_second_is_refused_and_one_taken_over_stops(
    start_service, buffer: SampleBuffer
) -> None:
    """A second broker on a run (a service scaled to two, one started by hand) wrote its own
    `version:engines` and status over the first's; now its start is refused, exit 2, naming the
    first. A broker stopped past its lease's expiry is taken over, and stops when it goes on.
    A broker that holds the lease forgets the last one's `version:engines` (a resume's engines
    start on the model's weights: the router took them for that version's); one refused not."""
    run = buffer.config.run_id
    flags = ["broker", "--port", "0", "--redis-url", buffer.config.redis_url, "--run-id", run]
    buffer.set_version("engines", 81)  # the last launch's broker's
    first = start_service("first", flags)
    assert buffer.get_version("engines") == -1
    buffer.set_version("engines", 5)  # as the first would once it synced its engines
    second = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *flags], capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"another broker holds run {run}: broker pid {first.proc.pid} on " in second.stderr
    assert buffer.get_version("engines") == 5, "the refused broker left the first's word"
    first.proc.send_signal(signal.SIGSTOP)
    try:
        third = start_service("third", flags)  # waits the stopped one's lease out
    finally:
        first.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: httpx.get(f"{first.url}/health").status_code == 503, "the first to stop")
    assert buffer.get_version("engines") == -1, "the third took it back"
    problem = httpx.get(f"{first.url}/health").json()["problem"]
    assert f"another broker took run {run} over: broker pid {third.proc.pid} on " in problem
    assert httpx.get(f"{third.url}/health").status_code == 200
    first.stop()  # (the lease is the third's: the first does not give it up)
    time.sleep(1.5)
    assert httpx.get(f"{third.url}/health").status_code == 200
    holder = buffer.redis.get(buffer.lease_prefix + "broker").decode()
    assert holder.startswith(f"broker pid {third.proc.pid} on "), holder
    third.stop()  # SIGTERM: a clean stop, exit 0 (it died of the signal), the lease given up
    assert third.proc.returncode == 0 and not buffer.redis.exists(buffer.lease_prefix + "broker")
