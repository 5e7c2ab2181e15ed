"""The weight broker survives malformed frames (rejected and counted, no loop dies) and a disk it
cannot write, reports a dead loop as unhealthy, checks engine URLs, and lets only the run's
token change its engines."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from proto import TensorMeta, WeightBucketHeader, WeightRequest, encode
from services.weight_sync.zmq_transport import ERROR_FRAME
from tests.helpers import wait_until

TOKEN = "broker-test-token"


@pytest.fixture
def broker(start_service):  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_API_TOKEN", TOKEN)
        mp.delenv("TANDEM_WEIGHT_SECRET", raising=False)
        return start_service("broker", ["broker", "--port", "0"])


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_malformed_frames_are_rejected_and_counted_and_every_loop_lives(broker) -> None:  # type: ignore[no-untyped-def]
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.connect(broker.info["intake_endpoint"])
    tensor = np.zeros(4, dtype=np.float32)
    meta = [TensorMeta("w", "float32", [4])]
    out_of_range = WeightBucketHeader(version=1, bucket_index=5, num_buckets=2, tensors=meta)
    in_range = WeightBucketHeader(version=1, bucket_index=0, num_buckets=2, tensors=meta)
    for message in (
        [b"garbage", b"more"],
        [encode(in_range), tensor.tobytes()],  # half of version 1: kept, incomplete
        [encode(out_of_range), tensor.tobytes()],  # would "complete" version 1 with a hole
        [b""],
    ):
        push.send_multipart(message)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(broker.info["serve_endpoint"])
    dealer.send_multipart([b"one", b"two"])  # two payload frames: not a WeightRequest
    assert dealer.recv_multipart()[0] == ERROR_FRAME
    dealer.send_multipart([b"\xc1"])  # not msgpack
    assert dealer.recv_multipart()[0] == ERROR_FRAME
    dealer.send(encode(WeightRequest(version=1)))  # the fetch loop still answers
    reply = dealer.recv_multipart()
    assert reply[0] == ERROR_FRAME and b"no weight version 1" in reply[1]
    push.close()
    dealer.close()
    url = broker.url
    # (the intake loop reads its frames apart from the fetch loop: under load it may not have
    # read the last one when the fetch loop has answered)
    wait_until(lambda: metric(url, "tandem_broker_buckets_rejected_total") >= 3, "3 rejected")
    assert metric(url, "tandem_broker_buckets_rejected_total") == 3
    assert metric(url, "tandem_broker_frames_rejected_total") == 2
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/state").json()["version"] == -1


def test_engine_registration_checks_the_url_the_size_and_the_token(broker) -> None:  # type: ignore[no-untyped-def]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for bad in ("not a url", "", "ftp://x", "http://", "http://h:99999"):
        reply = httpx.post(broker.url + "/engines", json={"url": bad}, headers=auth)
        assert reply.status_code == 422 and "url" in reply.text, bad
    # a number past a float in a refused body: 422 with it as null (FastAPI's own: a 500)
    inf = '{"url": "x", "weight_version": 1e400}'
    reply = httpx.post(
        broker.url + "/engines", content=inf, headers={**auth, "content-type": "application/json"}
    )
    assert (
        reply.status_code == 422
        and '"finite_number"' in reply.text
        and '"input":null' in reply.text
    ), reply.text
    for body, status, words in [
        ('{"url": "\\ud800"}', 400, "not valid JSON"),  # a lone surrogate: was a 500
        ('{"url": "x", "weight_version": 1' + "0" * 30 + "}", 422, "url"),  # past 64 bits: 500
    ]:
        headers = {**auth, "content-type": "application/json"}
        reply = httpx.post(broker.url + "/engines", content=body, headers=headers)
        assert reply.status_code == status and words in reply.text, (body, reply.text)
    good = {"url": "http://127.0.0.1:9"}
    assert httpx.post(broker.url + "/engines", json=good).status_code == 401
    assert httpx.post(broker.url + "/engines", json=good, headers=auth).status_code == 200
    delete = httpx.delete(broker.url + "/engines", params=good)
    assert delete.status_code == 401
    assert httpx.get(broker.url + "/state").status_code == 200, "reads stay open"
    huge = {"url": "http://127.0.0.1:9/" + "a" * (2 << 20)}  # over the 1 MiB default
    reply = httpx.post(broker.url + "/engines", json=huge, headers=auth)
    assert reply.status_code == 413 and "--max-request-bytes" in reply.text
    spec = httpx.get(broker.url + "/openapi.json").json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert "requestBody" in spec["paths"]["/engines"]["post"]


def test_a_loop_that_fails_makes_health_503_naming_its_error() -> None:
    from fastapi.testclient import TestClient

    from services.weight_broker.config import BrokerConfig
    from services.weight_broker.server import create_app

    app = create_app(BrokerConfig())
    failing = asyncio.Event()

    async def next_version(wake: asyncio.Event) -> int:
        await failing.wait()
        raise RuntimeError("the intake broke")

    app.state.broker.transport.next_version = next_version
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        client.portal.call(failing.set)
        deadline = time.monotonic() + 10
        while (reply := client.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reply.status_code == 503, reply.text
        assert "the intake broke" in reply.json()["problem"]


async def test_a_disk_the_broker_cannot_write_fails_the_engines_not_the_loop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import aiohttp

    from services.weight_broker.transports import DiskTransport

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "file").write_text("")
    disk = DiskTransport(str(tmp_path / "file" / "versions"), str(model))  # under a file
    meta = [TensorMeta("w", "float32", [4])]
    header = WeightBucketHeader(version=1, bucket_index=0, num_buckets=1, tensors=meta)
    disk.store.add_bucket(header, [encode(header), np.zeros(4, np.float32).tobytes()])
    async with aiohttp.ClientSession() as session:
        outcomes = await disk.sync(session, ["http://127.0.0.1:9"], 1)
    assert "cannot prepare version 1" in outcomes["http://127.0.0.1:9"].error


@pytest.mark.parametrize(
    ("args", "needs"),
    [
        (["--host", "0.0.0.0"], "TANDEM_API_TOKEN"),
        (["--intake-endpoint", "tcp://0.0.0.0:*"], "TANDEM_WEIGHT_SECRET"),
    ],
)
def test_a_broker_alone_refuses_a_public_address_without_its_secret(args, needs) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if k not in {"TANDEM_API_TOKEN", needs}}
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "broker", "--port", "0", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and needs in done.stderr


def test_the_trainer_skips_and_counts_a_malformed_control_frame() -> None:
    from proto import NcclCommand
    from services.weight_sync.nccl_sender import NcclWeightSender

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sender = NcclWeightSender(f"tcp://127.0.0.1:{port}", timeout_s=10)
    try:
        sender._socket.send(b"hello")  # the broker learns the trainer's identity
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, b"\xc1garbage"])
        router.send_multipart([identity, encode(NcclCommand(action="done", version=3))])
        assert sender._receive(3).action == "done"
        assert sender.frames_rejected == 1
    finally:
        sender.close()
        router.close()


def test_the_trainers_rendezvous_refuses_a_public_address_without_the_weight_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.weight_sync.nccl_sender import NcclWeightSender

    monkeypatch.delenv("TANDEM_WEIGHT_SECRET", raising=False)
    with pytest.raises(ValueError, match="TANDEM_WEIGHT_SECRET") as refused:
        NcclWeightSender("tcp://127.0.0.1:1", master_address="10.1.2.3")
    assert "--weights-master-address 10.1.2.3" in str(refused.value)
    NcclWeightSender("tcp://127.0.0.1:1", master_address="127.0.0.1").close()
    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "a-secret")
    NcclWeightSender("tcp://127.0.0.1:1", master_address="10.1.2.3").close()


async def test_an_nccl_offer_that_fails_its_hmac_is_refused_naming_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    import torch

    from services.weight_broker.config import BrokerConfig
    from services.weight_broker.nccl_transport import NcclTransport
    from services.weight_sync.nccl_sender import NcclWeightSender, WeightSyncError

    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "right")
    counters = {"frames_rejected": 0}
    transport = NcclTransport(BrokerConfig(transport="nccl", sync_timeout_s=10), counters)
    offers = asyncio.create_task(transport.next_version(asyncio.Event()))
    monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "wrong")  # the trainer's differs
    sender = NcclWeightSender(transport.intake_endpoint, timeout_s=10)
    try:
        with pytest.raises(WeightSyncError, match="TANDEM_WEIGHT_SECRET"):
            await asyncio.to_thread(sender.send, 1, [("w", torch.zeros(4))])
        assert counters["frames_rejected"] == 1 and not offers.done()
        monkeypatch.setenv("TANDEM_WEIGHT_SECRET", "right")  # a signed offer is taken
        signed = asyncio.to_thread(sender.send, 2, [("w", torch.zeros(4))])
        signing = asyncio.ensure_future(signed)
        assert await asyncio.wait_for(offers, 10) == 2
        await transport.refuse(2, "test over")
        with pytest.raises(WeightSyncError, match="test over"):
            await signing
    finally:
        offers.cancel()
        sender.close()
        transport.stop()


def test_a_version_sent_again_or_an_older_one_is_refused_saying_which() -> None:
    from services.weight_broker.store import VersionStore

    store = VersionStore()

    def bucket(version: int) -> Any:
        meta = [TensorMeta("w", "float32", [4])]
        header = WeightBucketHeader(version=version, bucket_index=0, num_buckets=1, tensors=meta)
        return store.add_bucket(header, [encode(header), np.zeros(4, np.float32).tobytes()])

    assert bucket(2) is not None and store.latest == 2
    with pytest.raises(ValueError, match=r"^weight version 2 arrived again: it is held$"):
        bucket(2)
    with pytest.raises(ValueError, match="arrived after version 2: versions must increase"):
        bucket(1)
