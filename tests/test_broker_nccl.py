"""The broker's NCCL transport on CPU (gloo): real engines join a weight group and receive each
version by broadcast from a trainer-side `NcclWeightSender`, bucket by bucket, in order.

On GPUs the same code runs with NCCL (the backend follows the tensors' device).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.weight_sync.nccl_sender import NcclWeightSender, WeightSyncError
from services.weight_sync.wire import group_by_bytes
from tests.helpers import JsonHandler

PROMPT = [1, 7, 11, 14]  # <bos> 3 7 >


def perturbed_weights(
    model_dir, seed: int
) -> tuple[list[tuple[str, torch.Tensor]], torch.nn.Module]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()], model.eval()


def engine_logprobs(url: str) -> tuple[str, list[int], list[float]]:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
    }
    out = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    triples = out["meta_info"]["output_token_logprobs"]
    return out["meta_info"]["weight_version"], [t[1] for t in triples], [t[0] for t in triples]


def teacher_forced(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]


@pytest.fixture
def stack(start_service, toy_model_dir):
    def _start(n_engines: int, *broker_flags: str):
        engines = [
            start_service(
                f"engine{i}",
                [
                    "engine",
                    "--model",
                    str(toy_model_dir),
                    "--port",
                    "0",
                    "--update-timeout-s",
                    "20",
                ],
            )
            for i in range(n_engines)
        ]
        broker = start_service(
            "broker",
            [
                "broker",
                "--port",
                "0",
                "--transport",
                "nccl",
                *broker_flags,
                "--engine-urls",
                *[e.url for e in engines],
            ],
        )
        return engines, broker

    return _start


def test_each_version_is_broadcast_to_every_engine_in_order(stack, toy_model_dir) -> None:
    engines, broker = stack(2, "--sync-timeout-s", "30")
    # Small buckets: the version travels as many ordered broadcasts.
    sender = NcclWeightSender(broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=30)
    for version in (1, 2):
        tensors, model = perturbed_weights(toy_model_dir, seed=version)
        sent = sender.send(version, tensors)
        assert sent == sum(t.numel() * t.element_size() for _, t in tensors)
        for engine in engines:
            served, tokens, logprobs = engine_logprobs(engine.url)
            assert served == str(version)
            expected = teacher_forced(model, tokens)
            assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
    state = httpx.get(f"{broker.url}/state").json()
    assert state["version"] == 2
    assert [e["version"] for e in state["engines"]] == [2, 2]
    sender.close()


@pytest.mark.parametrize("load_format", ["flattened_bucket", "per_tensor"])
def test_an_engine_without_bucket_sizes_gets_one_request_per_bucket_and_ends_on_the_version(
    start_service, toy_model_dir, load_format: str
) -> None:
    """Tandem's engine gets a whole version per request and applies it once; an engine that
    does not advertise `bucket_sizes` (as SGLang) gets a chain of per-bucket requests. Both
    join the same broadcasts, of float32 and bfloat16 tensors mixed."""
    args = ["engine", "--model", str(toy_model_dir), "--port", "0", "--update-timeout-s", "20"]
    whole = start_service("whole", args)
    chained = start_service("chained", [*args, "--no-whole-version-updates"])
    broker = start_service(
        "broker",
        [
            "broker",
            "--port",
            "0",
            "--transport",
            "nccl",
            "--nccl-load-format",
            load_format,
            "--sync-timeout-s",
            "30",
            "--engine-urls",
            whole.url,
            chained.url,
        ],
    )
    bucket_bytes = 16 * 1024
    sender = NcclWeightSender(
        broker.info["intake_endpoint"], bucket_bytes=bucket_bytes, timeout_s=30
    )
    tensors, model = perturbed_weights(toy_model_dir, seed=1)
    tensors = [(n, t.bfloat16() if i % 3 == 0 else t) for i, (n, t) in enumerate(tensors)]
    model.load_state_dict({n: t.float() for n, t in tensors})
    buckets = len(group_by_bytes(tensors, bucket_bytes, ramp=True))  # as the sender groups
    assert buckets > 2
    sender.send(1, tensors)
    for engine in (whole, chained):
        served, tokens, logprobs = engine_logprobs(engine.url)
        assert served == "1"
        expected = teacher_forced(model, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
    applied = [line for line in whole.log().splitlines() if "tensors loaded in" in line]
    assert len(applied) == 1 and f"{len(tensors)} tensors" in applied[0]
    chain = [line for line in chained.log().splitlines() if "tensors loaded in" in line]
    assert len(chain) == buckets
    sender.close()


class ForgetfulProxy(JsonHandler):
    """Passes every request to a real engine (`target`), except that it answers the first
    update that names a layout by `layout_id` alone with the engine's 409 for an unknown id,
    as an engine would that no longer has it. `updates` lists (version, listed?, answer)."""

    target = ""
    updates: ClassVar[list[tuple[str, bool, int]]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server names it
        reply = httpx.get(self.target + self.path, timeout=60)
        self.send_json(reply.status_code, reply.json())

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        listed = "names" in body
        forgot = any(status == 409 for *_, status in self.updates)
        if self.path == "/update_weights_from_distributed" and not listed and not forgot:
            self.updates.append((body["weight_version"], listed, 409))
            self.send_json(409, {"success": False, "message": "layout_id is unknown"})
            return
        reply = httpx.post(self.target + self.path, json=body, timeout=60)
        if self.path == "/update_weights_from_distributed":
            self.updates.append((body["weight_version"], listed, reply.status_code))
        self.send_json(reply.status_code, reply.json())


def test_an_engine_that_no_longer_knows_the_layout_gets_the_full_request(
    start_service, toy_model_dir
) -> None:
    """Once an engine took a layout, the broker sends only its `layout_id`; a 409 (the engine
    forgot it) is answered before any collective, and the broker then sends the full list."""
    engine = start_service(
        "engine",
        ["engine", "--model", str(toy_model_dir), "--port", "0", "--update-timeout-s", "20"],
    )
    handler = type("Proxy", (ForgetfulProxy,), {"target": engine.url, "updates": []})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        broker = start_service(
            "broker",
            [
                "broker",
                "--port",
                "0",
                "--transport",
                "nccl",
                "--sync-timeout-s",
                "30",
                "--engine-urls",
                proxy_url,
            ],
        )
        sender = NcclWeightSender(
            broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=30
        )
        for version in (1, 2, 3):
            tensors, model = perturbed_weights(toy_model_dir, seed=version)
            sender.send(version, tensors)
            served, tokens, logprobs = engine_logprobs(engine.url)
            assert served == str(version)
            expected = teacher_forced(model, tokens)
            assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
        sender.close()
        assert handler.updates == [
            ("1", True, 200),  # a new layout: listed in full
            ("2", False, 409),  # the same layout by id: "unknown"
            ("2", True, 200),  # so in full again
            ("3", False, 200),  # and by id from then on
        ]
    finally:
        proxy.shutdown()
        proxy.server_close()


class PauseLostProxy(JsonHandler):
    """Passes every request to a real engine (`target`), but answers its `/pause_generation`
    with 500 after the engine paused (as if the answer were lost on the way back)."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server names it
        reply = httpx.get(self.target + self.path, timeout=60)
        self.send_json(reply.status_code, reply.json())

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        reply = httpx.post(self.target + self.path, json=body, timeout=60)
        lost = self.path == "/pause_generation"
        self.send_json(
            500 if lost else reply.status_code, {"error": "lost"} if lost else reply.json()
        )


def test_an_engine_paused_by_a_version_that_failed_is_resumed(start_service, toy_model_dir) -> None:
    """The only engine's pause answers an error although it paused: the version is aborted, and
    the engine is resumed (before, a failed pause left every engine that did pause paused for
    good, the run with it)."""
    engine = start_service(
        "engine",
        ["engine", "--model", str(toy_model_dir), "--port", "0", "--update-timeout-s", "20"],
    )
    handler = type("Proxy", (PauseLostProxy,), {"target": engine.url})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
        flags = ["--transport", "nccl", "--pause-mode", "in_place", "--sync-timeout-s", "10"]
        broker = start_service(
            "broker", ["broker", "--port", "0", *flags, "--engine-urls", proxy_url]
        )
        sender = NcclWeightSender(broker.info["intake_endpoint"], timeout_s=30)
        with pytest.raises(WeightSyncError, match="aborted"):
            sender.send(1, perturbed_weights(toy_model_dir, seed=1)[0])
        sender.close()
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        reply = httpx.post(f"{engine.url}/generate", json=body, timeout=10)  # paused: no answer
        assert reply.status_code == 200 and reply.json()["meta_info"]["weight_version"] == "0"
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.slow
def test_a_hung_then_dead_engine_is_dropped_and_the_others_keep_getting_versions(
    stack, toy_model_dir
) -> None:
    engines, broker = stack(2, "--sync-timeout-s", "6")
    sender = NcclWeightSender(broker.info["intake_endpoint"], bucket_bytes=16 * 1024, timeout_s=30)
    tensors, _ = perturbed_weights(toy_model_dir, seed=1)
    sender.send(1, tensors)
    healthy, victim = engines
    os.kill(victim.proc.pid, signal.SIGSTOP)  # hangs mid-update from the broker's view
    try:
        tensors, model = perturbed_weights(toy_model_dir, seed=2)
        started = time.monotonic()
        # The broker times the victim out, forms a group without it and retries: the healthy
        # engine gets all of version 2, never a mix of buckets from two versions.
        sender.send(2, tensors)
        assert time.monotonic() - started < 60
    finally:
        os.kill(victim.proc.pid, signal.SIGKILL)
    served, tokens, logprobs = engine_logprobs(healthy.url)
    assert served == "2"
    expected = teacher_forced(model, tokens)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
    state = {e["url"]: e for e in httpx.get(f"{broker.url}/state").json()["engines"]}
    assert state[victim.url]["in_rotation"] is False
    assert state[victim.url]["last_error"]
    # The run goes on: the next version needs no retry.
    tensors, _ = perturbed_weights(toy_model_dir, seed=3)
    sender.send(3, tensors)
    assert engine_logprobs(healthy.url)[0] == "3"
    sender.close()


def test_with_no_engine_left_the_version_is_aborted_not_hung(stack, toy_model_dir) -> None:
    engines, broker = stack(1, "--sync-timeout-s", "4")
    os.kill(engines[0].proc.pid, signal.SIGKILL)
    sender = NcclWeightSender(broker.info["intake_endpoint"], timeout_s=30)
    tensors, _ = perturbed_weights(toy_model_dir, seed=1)
    with pytest.raises(WeightSyncError, match="aborted"):
        sender.send(1, tensors)
    sender.close()


def test_ramped_buckets_start_small_and_keep_every_tensor_in_order() -> None:
    tensors = [(f"t{i}", torch.empty(100, dtype=torch.uint8)) for i in range(40)]
    tensors.insert(1, ("big", torch.empty(500, dtype=torch.uint8)))  # over the first limit
    groups = group_by_bytes(tensors, 1600, ramp=True)
    sizes = [sum(t.nbytes for _, t in g) for g in groups]
    assert sizes == [100, 500, 800, 1600, 1500]  # limits 200, 400, 800, then 1600
    assert [n for g in groups for n, _ in g] == [n for n, _ in tensors]
    assert [len(g) for g in group_by_bytes(tensors, 1600)][:2] == [12, 16]  # no ramp
