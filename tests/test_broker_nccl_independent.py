"""Engines synced independently on the NCCL path, on CPU (gloo): a broker process, two real
reference engines joining its weight groups and a trainer-side `NcclWeightSender`. One engine
stopped with SIGSTOP (a hung GPU or host), either between versions or in the middle of a
transfer, is left behind and out of rotation; the other takes every later version, each
recorded per engine as it takes it, and the gate (`version:engines` in a real Valkey) follows
the engine that serves; once resumed and registered again (as the router does when
it answers), the stopped one is kept out of the gate until it is brought to the newest version.

The time the running engine waited for each version while the other was stopped is printed
(`-s` shows it), not asserted: speed lives in bench/.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from typing import ClassVar

import httpx
import pytest

from proto import NcclAck, decode, encode
from services.sample_buffer import SampleBuffer
from services.weight_sync.nccl_sender import NcclWeightSender
from tests.helpers import JsonHandler, serving, wait_until
from tests.test_broker_nccl import engine_logprobs, perturbed_weights, teacher_forced

SYNC_TIMEOUT_S = "30"  # every wait below is shorter: only leaving the stopped engine lets them pass


class StopOnUpdateProxy(JsonHandler):
    """Passes every request to a real engine (`target`); the first weight update it is sent
    stops the engine (SIGSTOP, `pid`): before passing it on when `when` is "mid-transfer" (the
    engine joined the group and the trainer broadcasts, but it never receives), after the
    engine answered when "before answering" (it took the version; the answer is held until
    `release` is set, as a stopped host would hold it)."""

    target = ""
    pid = 0
    when = ""
    stopped: ClassVar[list[str]] = []
    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server names it
        reply = httpx.get(self.target + self.path, timeout=60)
        self.send_json(reply.status_code, reply.json())

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        first = self.path == "/update_weights_from_distributed" and not self.stopped
        if first:
            self.stopped.append(body["weight_version"])
            if self.when == "mid-transfer":
                os.kill(self.pid, signal.SIGSTOP)
        try:
            reply = httpx.post(self.target + self.path, json=body, timeout=60)
        except httpx.HTTPError as exc:  # (the broker gave up on this request long before)
            self.send_json(502, {"error": str(exc)})
            return
        if first and self.when == "before answering":
            os.kill(self.pid, signal.SIGSTOP)
            self.release.wait(60)
        with contextlib.suppress(OSError):  # (the broker no longer waits for it)
            self.send_json(reply.status_code, reply.json())


def engine_args(toy_model_dir) -> list[str]:  # type: ignore[no-untyped-def]
    return ["engine", "--model", str(toy_model_dir), "--port", "0", "--update-timeout-s", "20"]


def broker_state(broker) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    return {e["url"]: e for e in httpx.get(f"{broker.url}/state", timeout=10).json()["engines"]}


def assert_serves(url: str, version: int, model) -> None:  # type: ignore[no-untyped-def]
    """The engine at `url` serves `version`, its log-probs those of `model`'s weights."""
    served, tokens, logprobs = engine_logprobs(url)
    assert served == str(version)
    expected = teacher_forced(model, tokens)  # type: ignore[arg-type]
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4


def send_and_time(sender: NcclWeightSender, version: int, model_dir) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    tensors, model = perturbed_weights(model_dir, seed=version)
    started = time.monotonic()
    sender.send(version, tensors)
    return time.monotonic() - started, model


@pytest.mark.parametrize("when", ["between versions", "mid-transfer", "before answering"])
def test_a_stopped_engine_is_left_behind_while_the_other_takes_each_version_and_comes_back(
    start_service, toy_model_dir, buffer: SampleBuffer, when: str
) -> None:
    running = start_service("running", engine_args(toy_model_dir))
    victim = start_service("victim", engine_args(toy_model_dir))
    release = threading.Event()
    handler = type(
        "Proxy",
        (StopOnUpdateProxy,),
        {
            "target": victim.url,
            "pid": victim.proc.pid,
            "when": when,
            "stopped": [],
            "release": release,
        },
    )
    with serving(handler) as proxy_url:
        # The victim is the last rank: gloo's root sends to each engine itself.
        victim_url = victim.url if when == "between versions" else proxy_url
        flags = ["--transport", "nccl", "--sync-timeout-s", SYNC_TIMEOUT_S]
        flags += ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
        broker = start_service(
            "broker", ["broker", "--port", "0", *flags, "--engine-urls", running.url, victim_url]
        )
        sender = NcclWeightSender(
            broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=60
        )
        try:
            if when == "between versions":
                send_and_time(sender, 1, toy_model_dir)
                assert [e["version"] for e in broker_state(broker).values()] == [1, 1]
                os.kill(victim.proc.pid, signal.SIGSTOP)
            waited = {}
            for version in (2, 3, 4):
                waited[version], model = send_and_time(sender, version, toy_model_dir)
                assert_serves(running.url, version, model)
                state = broker_state(broker)
                assert state[running.url]["version"] == version
                assert state[running.url]["in_rotation"] is True
                assert state[victim_url]["in_rotation"] is False
                # The gate (`version:engines`) follows the engine that serves.
                wait_until(
                    lambda v=version: buffer.get_version("engines") == v, f"gate at {version}"
                )
            print(f"\n[{when}] the running engine waited for each version (s): {waited}")
            left = broker_state(broker)[victim_url]
            if when == "between versions":
                assert left["version"] == 1
                assert "did not answer GET /model_info before the broadcast" in left["last_error"]
            else:
                assert handler.stopped == ["2"]
                assert left["version"] == -1  # (nothing recorded: it was never heard to take one)
                assert "left behind: no answer within" in left["last_error"]
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
            release.set()
        # Resumed, it answers again; the router registers it at the version it reports. It is
        # behind: out of rotation (the gate keeps following the engine that serves) until the
        # trainer's next version (or a re-send) brings it to the newest.
        wait_until(
            lambda: httpx.get(f"{victim.url}/model_info", timeout=5).status_code == 200,
            "the resumed engine to answer",
        )
        reported = int(httpx.get(f"{victim.url}/model_info", timeout=5).json()["weight_version"])
        assert reported < 4
        body = {"url": victim_url, "weight_version": reported}
        httpx.post(f"{broker.url}/engines", json=body, timeout=10).raise_for_status()
        back = broker_state(broker)[victim_url]
        assert (back["version"], back["in_rotation"]) == (reported, False)
        assert buffer.get_version("engines") == 4, "the resumed engine pulled the gate back"
        _, model = send_and_time(sender, 5, toy_model_dir)
        for engine in (running, victim):
            assert_serves(engine.url, 5, model)
        state = broker_state(broker)
        assert [(e["version"], e["in_rotation"]) for e in state.values()] == [(5, True)] * 2
        wait_until(lambda: buffer.get_version("engines") == 5, "gate at 5")
        sender.close()


class FirstAckFails:
    """A trainer's control socket whose first broadcast ack says the broadcast failed after
    its data went out (a trainer whose step after the collectives raised, or whose ack lost a
    member it no longer needed); every frame is passed on, each ack recorded."""

    def __init__(self, socket) -> None:  # type: ignore[no-untyped-def]
        self.socket, self.acks = socket, []

    def send(self, data: bytes) -> None:
        try:
            ack = decode(data, NcclAck)
        except ValueError:  # the version's offer
            self.socket.send(data)
            return
        if not self.acks:
            ack.ok, ack.error = False, "the trainer's step after the broadcast raised"
        self.acks.append((ack.version, ack.attempt, ack.ok))
        self.socket.send(encode(ack))

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.socket, name)


def test_engines_that_answered_a_failed_broadcast_are_counted_on_its_version_not_sent_it_again(
    start_service, toy_model_dir, buffer: SampleBuffer
) -> None:
    engines = [start_service(f"engine{i}", engine_args(toy_model_dir)) for i in range(2)]
    urls = [e.url for e in engines]
    flags = ["--transport", "nccl", "--sync-timeout-s", SYNC_TIMEOUT_S, "--engine-urls", *urls]
    flags += ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    broker = start_service("broker", ["broker", "--port", "0", *flags])
    sender = NcclWeightSender(broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=60)
    sender._socket = control = FirstAckFails(sender._socket)
    try:
        _, model = send_and_time(sender, 1, toy_model_dir)
        # Both answered the update: they have version 1 (served, exact), and no retry re-sent it.
        assert control.acks == [(1, 0, False)], control.acks
        for engine in engines:
            assert_serves(engine.url, 1, model)
        state = broker_state(broker)
        assert [(e["version"], e["in_rotation"]) for e in state.values()] == [(1, True)] * 2
        wait_until(lambda: buffer.get_version("engines") == 1, "gate at 1")
        # The trainer left its failed group: the next version forms a fresh one, taken by both.
        _, model = send_and_time(sender, 2, toy_model_dir)
        assert control.acks[1:] == [(2, 0, True)], control.acks
        state = broker_state(broker)
        assert [(e["version"], e["in_rotation"]) for e in state.values()] == [(2, True)] * 2
    finally:
        sender.close()
