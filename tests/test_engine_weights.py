"""Weight updates of a real `tandem engine` process.

The far edge (the weight broker) is a small ZMQ ROUTER in this test that answers a
`WeightRequest` with buckets from `services.weight_sync.wire.make_buckets`, the broker's real
wire format. Checks: the new version is reported and logprobs follow the new weights; a bad
name or shape is refused with the old weights kept; an update waits for the request in flight,
which is answered wholly by the old weights.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import zmq

from proto import WeightRequest, decode
from services.weight_sync.wire import make_buckets, secret_from_env

PROMPT = [1, 4, 5, 14]


class FakeBroker:
    """Answers each `WeightRequest` with the buckets of the version it holds (or ERR)."""

    def __init__(self) -> None:
        self.versions: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.requests: list[int] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, raw = self._sock.recv_multipart()
            version = decode(raw, WeightRequest).version
            self.requests.append(version)
            if version not in self.versions:
                self._sock.send_multipart([identity, b"ERR", b"no such version"])
                continue
            for bucket in make_buckets(self.versions[version], version, 4096, secret_from_env()):
                self._sock.send_multipart([identity, *bucket])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    fake = FakeBroker()
    yield fake
    fake.close()


def load_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturbed(model: torch.nn.Module, scale: float) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (name, t + scale * torch.randn(t.shape, generator=gen))
        for name, t in model.state_dict().items()
    ]


def teacher_forced(model: torch.nn.Module, output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def sample(url: str, max_new_tokens: int = 12) -> dict:
    resp = httpx.post(
        f"{url}/generate",
        timeout=120,
        json={
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
            },
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def logprob_error(model: torch.nn.Module, result: dict) -> float:
    got = torch.tensor([e[0] for e in result["meta_info"]["output_token_logprobs"]])
    return float((got - teacher_forced(model, result["output_ids"])).abs().max())


def update(url: str, endpoint: str, version: str) -> httpx.Response:
    body = {"endpoint": endpoint, "weight_version": version, "flush_cache": True}
    return httpx.post(f"{url}/update_weights_from_zmq", json=body, timeout=120)


def test_zmq_update_sets_the_version_and_logprobs_follow_the_new_weights(
    start_service, toy_model_dir: Path, broker: FakeBroker
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    old = load_model(toy_model_dir)
    new = load_model(toy_model_dir)
    new.load_state_dict(dict(perturbed(old, 0.5)))
    broker.versions[3] = list(new.state_dict().items())

    before = sample(engine.url)
    assert before["meta_info"]["weight_version"] == "0"
    assert logprob_error(old, before) < 1e-4
    assert sample(engine.url)["meta_info"]["cached_tokens"] == len(PROMPT)  # prompt cached

    resp = update(engine.url, broker.endpoint, "3")
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"] is True
    assert resp.json()["weight_version"] == "3"
    assert broker.requests == [3]

    after = sample(engine.url)
    assert after["meta_info"]["weight_version"] == "3"
    assert after["meta_info"]["cached_tokens"] == 0  # the update dropped the old weights' cache
    assert logprob_error(new, after) < 1e-4
    assert logprob_error(old, after) > 1e-3  # really the new weights, not the old ones
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "3"}

    # Versions only go forward: a lower one is refused naming both (the same one is taken).
    broker.versions[2] = perturbed(old, 0.9)
    assert update(engine.url, broker.endpoint, "3").status_code == 200
    for path, body in (
        ("/update_weights_from_zmq", {"endpoint": broker.endpoint, "weight_version": "2"}),
        ("/update_weights_from_disk", {"model_path": str(toy_model_dir), "weight_version": "1"}),
    ):
        resp = httpx.post(f"{engine.url}{path}", json=body, timeout=60)
        assert resp.status_code == 409, resp.text
        message = resp.json()["message"]
        assert f"weight_version {body['weight_version']} is older than version 3" in message
    assert broker.requests == [3, 3], "a refused version is not even fetched"
    assert logprob_error(new, sample(engine.url)) < 1e-4


@pytest.mark.parametrize("defect", ["unknown_name", "wrong_shape"])
def test_a_bad_name_or_shape_is_refused_and_the_old_weights_stay(
    start_service, toy_model_dir: Path, broker: FakeBroker, defect: str
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    old = load_model(toy_model_dir)
    tensors = perturbed(old, 0.5)
    if defect == "unknown_name":
        tensors.append(("model.layers.9.mlp.up_proj.weight", torch.zeros(3, 3)))
    else:
        name, t = tensors[-1]
        tensors[-1] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))
    broker.versions[1] = tensors

    resp = update(engine.url, broker.endpoint, "1")
    assert resp.status_code == 400
    assert resp.json()["success"] is False
    assert "model.layers" in resp.json()["message"] or "lm_head" in resp.json()["message"]

    after = sample(engine.url)
    assert after["meta_info"]["weight_version"] == "0"
    assert logprob_error(old, after) < 1e-4


def test_an_unknown_version_or_silent_broker_fails_without_hanging(
    start_service, toy_model_dir: Path, broker: FakeBroker
) -> None:
    engine = start_service(
        "engine",
        ["engine", "--model", str(toy_model_dir), "--port", "0", "--update-timeout-s", "2"],
    )
    resp = update(engine.url, broker.endpoint, "42")  # the broker does not hold it
    assert resp.status_code == 400 and resp.json()["success"] is False
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        resp = update(engine.url, f"tcp://127.0.0.1:{port}", "5")
        assert resp.status_code == 504 and resp.json()["success"] is False
    finally:
        silent.close(0)
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "0"}


def test_update_waits_for_the_request_in_flight_which_is_answered_by_old_weights(
    start_service, toy_model_dir: Path, broker: FakeBroker
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    old = load_model(toy_model_dir)
    new = load_model(toy_model_dir)
    new.load_state_dict(dict(perturbed(old, 0.5)))
    broker.versions[1] = list(new.state_dict().items())
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long_running = [pool.submit(sample, engine.url, 50) for _ in range(3)]
        time.sleep(0.05)
        updating = pool.submit(update, engine.url, broker.endpoint, "1")
        results = [f.result() for f in long_running]
        assert updating.result().status_code == 200
    for result in results:
        version = result["meta_info"]["weight_version"]
        model = {"0": old, "1": new}[version]
        assert logprob_error(model, result) < 1e-4  # every token from one set of weights
    assert sample(engine.url)["meta_info"]["weight_version"] == "1"


def test_update_from_disk_loads_new_weights_and_a_bad_directory_keeps_the_old(
    start_service, toy_model_dir: Path, tmp_path: Path
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    old = load_model(toy_model_dir)
    new = load_model(toy_model_dir)
    new.load_state_dict(dict(perturbed(old, 0.5)))
    new.save_pretrained(tmp_path / "v2")

    broken = tmp_path / "broken"
    broken.mkdir()
    resp = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        timeout=60,
        json={"model_path": str(broken), "weight_version": "9"},
    )
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert sample(engine.url)["meta_info"]["weight_version"] == "0"
    assert logprob_error(old, sample(engine.url)) < 1e-4

    resp = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        timeout=60,
        json={"model_path": str(tmp_path / "v2"), "weight_version": "2"},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"] is True
    after = sample(engine.url)
    assert after["meta_info"]["weight_version"] == "2"
    assert logprob_error(new, after) < 1e-4


def test_distributed_update_receives_broadcasts_in_order_over_gloo(
    start_service, toy_model_dir: Path
) -> None:
    """The test process is the trainer (rank 0); the engine joins at rank_offset 1."""
    from datetime import timedelta

    import torch.distributed as dist

    from services.common.serving import bind_socket
    from services.weight_sync.process_group import join_group

    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    old = load_model(toy_model_dir)
    new_tensors = perturbed(old, 0.5)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joined = pool.submit(
            httpx.post,
            f"{engine.url}/init_weights_update_group",
            timeout=60,
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "weight_update_group",
                "backend": "gloo",
                "timeout_s": 3,  # Tandem's extension: the group's collectives give up after it
            },
        )
        group = join_group(
            "127.0.0.1", port, 0, 2, "weight_update_group", "gloo", timedelta(seconds=60)
        )
        assert joined.result().status_code == 200, joined.result().text
        updated = pool.submit(
            httpx.post,
            f"{engine.url}/update_weights_from_distributed",
            timeout=60,
            json={
                "names": [n for n, _ in new_tensors],
                "dtypes": ["float32"] * len(new_tensors),
                "shapes": [list(t.shape) for _, t in new_tensors],
                "group_name": "weight_update_group",
                "flush_cache": True,
                "weight_version": "7",
            },
        )
        for _, tensor in new_tensors:
            dist.broadcast(tensor.contiguous(), src=0, group=group)
        resp = updated.result()
    assert resp.status_code == 200, resp.text
    assert resp.json()["weight_version"] == "7"
    new = load_model(toy_model_dir)
    new.load_state_dict(dict(new_tensors))
    after = sample(engine.url)
    assert after["meta_info"]["weight_version"] == "7"
    assert logprob_error(new, after) < 1e-4
    # A trainer that never broadcasts (it died): the engine gives up after the group's 3 s,
    # not its own 0.75x --update-timeout-s (90 s), and answers an error, its weights unchanged.
    started = time.monotonic()
    body = {"names": [new_tensors[0][0]], "dtypes": ["float32"], "weight_version": "8"}
    body["shapes"] = [list(new_tensors[0][1].shape)]
    resp = httpx.post(f"{engine.url}/update_weights_from_distributed", json=body, timeout=120)
    assert resp.status_code == 500 and time.monotonic() - started < 30, resp.text
    assert sample(engine.url)["meta_info"]["weight_version"] == "7"
    dist.destroy_process_group(group)


def test_update_while_paused_in_place_recomputes_the_kept_request_with_new_weights(
    start_service, toy_model_dir: Path, broker: FakeBroker, tmp_path: Path
) -> None:
    """SGLang's partial-rollout sequence: pause in place, update, continue. The kept request
    finishes; its cache was rebuilt with the new weights (one retraction), and it reports the
    new version."""
    import json
    import shutil

    model = tmp_path / "long"
    shutil.copytree(toy_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (model / "config.json").write_text(json.dumps(config))
    engine = start_service("engine", ["engine", "--model", str(model), "--port", "0"])
    old = load_model(toy_model_dir)
    broker.versions[1] = perturbed(old, 0.5)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        kept = pool.submit(sample, engine.url, 3000)
        deadline = time.monotonic() + 60
        while httpx.get(f"{engine.url}/get_load").json()[0]["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert (
            httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}).status_code
            == 200
        )
        assert update(engine.url, broker.endpoint, "1").status_code == 200
        assert not kept.done()
        assert httpx.post(f"{engine.url}/continue_generation", json={}).status_code == 200
        result = kept.result()
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3000}
    assert meta["weight_version"] == "1"
    assert meta["num_retractions"] == 1


def test_a_weight_group_on_another_backend_is_refused_naming_the_fix(
    start_service, toy_model_dir: Path
) -> None:
    """A GPU trainer (NCCL) and a CPU engine (gloo) could never meet in one group: refuse at
    once instead of letting the rendezvous time out."""
    engine_url = start_service(
        "engine", ["engine", "--model", str(toy_model_dir), "--port", "0"]
    ).url
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "nccl",
    }
    reply = httpx.post(f"{engine_url}/init_weights_update_group", json=body, timeout=30)
    assert reply.status_code == 400
    assert "--device cuda" in reply.text and "zmq" in reply.text


def test_weights_received_in_read_only_frames_print_no_warning() -> None:
    """A received bucket's tensors lie over its frames (read-only, not copied): torch's warning
    about it would reach every engine's console."""
    code = (
        "import torch\n"
        "from services.weight_sync.wire import bucket_tensors, make_buckets, parse_bucket\n"
        "message = [bytes(f) for f in make_buckets([('w', torch.ones(4))], 1)[0]]\n"
        "[(name, tensor)] = bucket_tensors(*parse_bucket(message, None))\n"
        "assert name == 'w' and tensor.tolist() == [1.0] * 4\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_weight_versions_are_integers_that_only_go_forward_negative_ones_too(
    start_service, toy_model_dir: Path
) -> None:
    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])

    def load(version: object) -> httpx.Response:
        body = {"model_path": str(toy_model_dir), "weight_version": version}
        return httpx.post(f"{engine.url}/update_weights_from_disk", json=body, timeout=60)

    assert load("2").json()["weight_version"] == "2"
    assert load("-1").status_code == 409, "below the version served, though not all digits"
    refused = load("v3")
    assert refused.status_code == 400 and "weight_version" in refused.json()["message"]
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "2"}
    assert "tandem_engine_weight_version 2" in httpx.get(f"{engine.url}/metrics").text
