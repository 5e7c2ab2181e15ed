"""Tandem speaks the pinned SGLang (0.5.23): the stand-in worker takes only what SGLang takes.

The stand-in (`tests/fake_sglang.py`) derives its routes and request validation from the
installed `sglang` package's source (`tests/sglang_surface.py`); these tests send it the bodies
Tandem's router and broker build, and check that it refuses what SGLang would refuse.
"""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from proto import sglang as sg
from proto.messages import NcclOffer, TensorMeta
from proto.run_terms import RunTerms
from services.common.engine_info import VersionUnavailableError, weight_version
from services.rollout_router.config import RolloutConfig, SamplingConfig
from services.rollout_router.rollout.loop import RolloutLoop
from services.rollout_router.samples import as_list
from services.weight_broker.nccl_transport import NcclTransport as NcclCoordinator
from services.weight_broker.transports import DiskTransport, as_json
from tests import sglang_surface
from tests.helpers import serving


def test_the_pinned_sglang_serves_no_get_weight_version_route() -> None:
    table = sglang_surface.routes()
    assert ("GET", "/model_info") in table and ("POST", "/generate") in table
    assert ("GET", "/get_weight_version") not in table


def test_the_stand_in_refuses_routes_and_fields_the_pinned_sglang_lacks(engines) -> None:  # type: ignore[no-untyped-def]
    url = engines().url
    assert httpx.get(f"{url}/get_weight_version").status_code == 404
    assert httpx.get(f"{url}/get_load").status_code == 404
    bad_param = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "seed": 3}}
    reply = httpx.post(f"{url}/generate", json=bad_param)
    assert reply.status_code == 400 and "seed" in reply.text
    bad_field = {"input_ids": [1, 2], "temperature": 0.5}
    reply = httpx.post(f"{url}/generate", json=bad_field)
    assert reply.status_code == 400 and "temperature" in reply.text
    reply = httpx.post(f"{url}/update_weights_from_disk", json={"weight_version": "3"})
    assert reply.status_code == 400 and "model_path" in reply.text, "a required field"
    body = {"model_path": "/m", "weight_version": 3}
    reply = httpx.post(f"{url}/update_weights_from_disk", json=body)
    assert reply.status_code == 400 and "weight_version" in reply.text, "a wrong type"
    reply = httpx.post(f"{url}/pause_generation", json={"mode": "later"})
    assert reply.status_code == 400 and "mode" in reply.text


def test_weight_version_is_read_from_model_info_on_sglang_0_5_23(engines) -> None:  # type: ignore[no-untyped-def]
    url = engines("--weight-version", "7").url
    assert weight_version(url) == 7


def test_the_router_learns_a_sglang_engines_version_without_a_sync(  # type: ignore[no-untyped-def]
    engines, start_service, buffer, toy_model_dir
) -> None:
    from tests.helpers import wait_until

    url = engines("--weight-version", "7").url  # the router owns engine versions (/model_info)
    args = ["router", "--port", "0", "--engine-urls", url, "--model", str(toy_model_dir)]
    args += ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    router = start_service("router", [*args, "--no-rollout"]).url

    def version() -> object:
        workers = httpx.get(router + "/workers").json()["workers"]
        return next(w["weight_version"] for w in workers if w["url"] == url) == 7

    wait_until(version, "the router to read version 7 from the engine", 30)


def test_weight_version_falls_back_to_get_weight_version_on_older_servers() -> None:
    class OldServer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/get_weight_version"
            body = b'{"weight_version": "5"}' if ok else b"{}"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    with serving(OldServer) as url:
        assert weight_version(url) == 5
    with pytest.raises(VersionUnavailableError, match=r"engine http://127\.0\.0\.1"):
        weight_version(url, timeout_s=1)  # (no longer served)


def rollout_loop() -> RolloutLoop:
    sampling = SamplingConfig(
        rollout_max_response_len=6, rollout_top_p=0.9, rollout_top_k=20, rollout_stop=["</a>"]
    )
    return RolloutLoop(RunTerms(), RolloutConfig(), sampling, None, None, None, None, [2])  # type: ignore[arg-type]


def test_rollout_generate_bodies_are_accepted_and_give_n_samples(engines) -> None:  # type: ignore[no-untyped-def]
    url, loop = engines().url, rollout_loop()
    prompt = [1, 5, 6, 14]
    for body in (
        loop.gen.payload(prompt, 4, 6, False, 11),
        loop.gen.payload(prompt, 1, 6, True, 0),
    ):
        assert sglang_surface.generate_problem(body) is None
    outs = as_list(
        httpx.post(f"{url}/generate", json=loop.gen.payload(prompt, 4, 6, False, 11)).json()
    )
    assert len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) == 2, "copy k answers by its index"
    one = httpx.post(f"{url}/generate", json=loop.gen.payload(prompt, 1, 6, False, 3)).json()
    assert isinstance(one, dict) and one["output_ids"]


async def test_broker_weight_update_bodies_are_accepted(
    engines, toy_model_dir: Path, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    url = engines().url
    async with aiohttp.ClientSession() as session:
        disk = DiskTransport(str(tmp_path / "versions"), str(toy_model_dir))
        await disk.update(session, url, 3)  # raises unless 200 and success
    assert weight_version(url) == 3
    offer = NcclOffer(
        version=4,
        buckets=[[TensorMeta("model.embed_tokens.weight", "bfloat16", [8, 4])]],
        master_address="127.0.0.1",
        master_port=29500,
        backend="nccl",
    )
    for load_format in ("per_tensor", "flattened_bucket"):
        me: Any = SimpleNamespace(group_name="tandem_weights_1", load_format=load_format)
        body = as_json(NcclCoordinator._update_body(me, offer, offer.buckets[0], True))
        assert sglang_surface.check_body("UpdateWeightsFromDistributedReqInput", body) is None
        assert ("load_format" in body) == (load_format == "flattened_bucket")
    # SGLang gets its own fields; an engine advertising weight_update_group_timeout (ours),
    # also the trainer's group timeout
    me.group_timeout_s, me._takes = 30.0, {"http://ours": {"group_timeout"}}
    init = as_json(NcclCoordinator._init_body(me, offer, "http://sglang", 1, 2))
    assert sglang_surface.check_body("InitWeightsUpdateGroupReqInput", init) is None
    assert "timeout_s" not in init
    ours = as_json(NcclCoordinator._init_body(me, offer, "http://ours", 1, 2))
    assert ours["timeout_s"] == 30.0
    for mode in ("abort", "in_place", "retract"):
        pause = as_json(sg.PauseGenerationReqInput.model_validate({"mode": mode}))
        assert sglang_surface.check_body("PauseGenerationReqInput", pause) is None
        assert httpx.post(f"{url}/pause_generation", json=pause).status_code == 200
    resume = as_json(sg.ContinueGenerationReqInput())
    assert sglang_surface.check_body("ContinueGenerationReqInput", resume) is None
    assert httpx.post(f"{url}/continue_generation", json=resume).status_code == 200


# Tandem's additions to SGLang's request classes (documented in proto/sglang.py).
EXTENSIONS = {
    "UpdateWeightsFromDistributedReqInput": {"layout_id", "bucket_sizes"},
    "InitWeightsUpdateGroupReqInput": {"timeout_s"},
}


def test_proto_request_models_carry_exactly_the_fields_of_their_io_struct_namesakes() -> None:
    from pydantic import BaseModel

    from proto import sglang as sg

    classes = sglang_surface.request_classes()
    checked = 0
    for name in dir(sg):
        model = getattr(sg, name)
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or name not in classes:
            continue
        if name == "GenerateReqInput":  # published subset; the body itself is parsed by hand
            assert set(model.model_fields) <= set(classes[name])
            continue
        ours = set(model.model_fields) - EXTENSIONS.get(name, set())
        assert ours == set(classes[name]), name
        checked += 1
    assert checked >= 10
