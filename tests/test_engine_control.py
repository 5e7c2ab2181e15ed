"""Pause, continue, abort, flush and streaming against a real `tandem engine` process.

The toy model is copied with a long `max_position_embeddings` so that a request can run for
thousands of tokens: long enough to be caught in flight without any timing assumption (each test
polls `/get_load` until the request runs, then acts).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

PROMPT = [1, 4, 5, 14]
LONG = 30000
KEPT = 5000  # the paused request's length: it runs to the end


@pytest.fixture(scope="module")
def long_model_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(toy_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG + 100
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def engine(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from conftest import ServiceProcess

    service = ServiceProcess(
        ["engine", "--model", str(long_model_dir), "--port", "0"],
        tmp_path_factory.mktemp("engine"),
        "engine",
    )
    yield service
    service.stop()


def post(url: str, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body or {}, timeout=timeout)


def long_request(url: str, rid: str, max_new_tokens: int = LONG) -> dict:
    resp = post(
        url,
        "/generate",
        {
            "input_ids": PROMPT,
            "rid": rid,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_until(predicate, what: str, timeout_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def running(url: str) -> int:
    return httpx.get(f"{url}/get_load").json()[0]["num_running_reqs"]


def assert_partial_abort(result: dict) -> None:
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert isinstance(meta["finish_reason"]["message"], str)
    assert 0 < meta["completion_tokens"] < LONG
    assert len(result["output_ids"]) == meta["completion_tokens"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def test_abort_request_by_rid_returns_200_with_the_partial_output(engine) -> None:  # type: ignore[no-untyped-def]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = pool.submit(long_request, engine.url, "victim")
        wait_until(lambda: running(engine.url) > 0, "the request to run")
        assert post(engine.url, "/abort_request", {"rid": "victim"}).status_code == 200
        assert_partial_abort(victim.result())


def test_abort_all_ends_every_running_request(engine) -> None:  # type: ignore[no-untyped-def]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(long_request, engine.url, f"all-{i}") for i in range(3)]
        wait_until(lambda: running(engine.url) == 3, "three requests to run")
        assert post(engine.url, "/abort_request", {"abort_all": True}).status_code == 200
        for future in futures:
            assert_partial_abort(future.result())


def test_pause_in_abort_mode_aborts_and_new_requests_wait_until_continue(engine) -> None:  # type: ignore[no-untyped-def]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = pool.submit(long_request, engine.url, "paused-victim")
        wait_until(lambda: running(engine.url) > 0, "the request to run")
        assert post(engine.url, "/pause_generation", {"mode": "abort"}).status_code == 200
        assert_partial_abort(victim.result())
        waiting = pool.submit(long_request, engine.url, "latecomer", 5)
        wait_until(
            lambda: httpx.get(f"{engine.url}/get_load").json()[0]["num_waiting_reqs"] == 1,
            "the new request to queue",
        )
        assert not waiting.done()
        assert post(engine.url, "/continue_generation").status_code == 200
        assert waiting.result()["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


@pytest.mark.parametrize(("mode", "retractions"), [("in_place", 0), ("retract", 1)])
def test_pause_keeps_the_request_which_completes_after_continue(
    engine, mode: str, retractions: int
) -> None:  # type: ignore[no-untyped-def]
    # (long enough not to finish before the pause lands on a loaded machine: 1,000 tokens once
    # did, and the engine left paused then failed every later test of this module)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        kept = pool.submit(long_request, engine.url, f"kept-{mode}", KEPT)
        try:
            wait_until(lambda: running(engine.url) > 0, "the request to run")
            assert post(engine.url, "/pause_generation", {"mode": mode}).status_code == 200
            load = httpx.get(f"{engine.url}/get_load").json()[0]
            assert load["paused"] == 1
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (
                (1, 0) if mode == "in_place" else (0, 1)
            )
            assert not kept.done()
        finally:  # the engine is shared by the module's tests
            assert post(engine.url, "/continue_generation").status_code == 200
        result = kept.result()
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": KEPT}
    assert result["meta_info"]["num_retractions"] == retractions


def test_flush_cache_is_refused_while_a_request_runs(engine) -> None:  # type: ignore[no-untyped-def]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        victim = pool.submit(long_request, engine.url, "flush-victim")
        wait_until(lambda: running(engine.url) > 0, "the request to run")
        assert post(engine.url, "/flush_cache").status_code == 400
        post(engine.url, "/abort_request", {"rid": "flush-victim"})
        victim.result()
    assert post(engine.url, "/flush_cache").status_code == 200


def test_streaming_sends_cumulative_events_and_done(engine) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0},
    }
    events = []
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    plain = post(engine.url, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["output_ids"] == plain["output_ids"]
    assert chunks[-1]["text"] == plain["text"]


def test_a_client_that_disconnects_has_its_request_aborted(engine) -> None:  # type: ignore[no-untyped-def]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gone = pool.submit(httpx.post, f"{engine.url}/generate", json=body, timeout=1.0)
        wait_until(lambda: running(engine.url) > 0, "the request to run")
        with pytest.raises(httpx.TimeoutException):
            gone.result()
    wait_until(lambda: running(engine.url) == 0, "the engine to drop the abandoned request")


def test_streaming_several_samples_tags_each_event_with_its_index(engine) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "n": 3, "sampling_seed": 1},
    }
    last: dict[int, dict] = {}
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1, 2]
    plain = post(engine.url, "/generate", {**body, "stream": False}).json()
    assert [last[i]["output_ids"] for i in range(3)] == [r["output_ids"] for r in plain]


def test_release_memory_pauses_until_resume_and_weights_survive(engine) -> None:  # type: ignore[no-untyped-def]
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    before = post(engine.url, "/generate", body).json()["output_ids"]
    assert (
        post(
            engine.url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}
        ).status_code
        == 200
    )
    assert post(engine.url, "/continue_generation").status_code == 400  # must resume memory first
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(post, engine.url, "/generate", body)
        wait_until(
            lambda: httpx.get(f"{engine.url}/get_load").json()[0]["num_waiting_reqs"] == 1,
            "the request to queue",
        )
        assert not waiting.done()
        assert post(engine.url, "/resume_memory_occupation", {}).status_code == 200
        assert waiting.result().json()["output_ids"] == before


def test_a_storm_of_requests_aborts_pauses_and_updates_answers_every_request_well_formed(
    engine, long_model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    """Random mixes of sampling options, streaming, rid aborts, pauses (all modes) and weight
    reloads: every request still gets 200 and a complete answer (no lost or mixed-up rows)."""
    import asyncio
    import random

    import aiohttp

    rng = random.Random(0)

    def body(i: int) -> dict:
        params = {
            "max_new_tokens": rng.randint(0, 30),
            "temperature": rng.choice([0, 0.7, 1.0]),
            "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([-1, 3]),
            "n": rng.choice([1, 2, 4]),
            "ignore_eos": rng.random() < 0.5,
            "stop": [str(rng.randint(0, 9))] if rng.random() < 0.3 else [],
        }
        return {
            "input_ids": [1] + [rng.randint(4, 15) for _ in range(rng.randint(1, 12))],
            "sampling_params": params,
            "return_logprob": True,
            "rid": f"storm-{i}",
            "stream": rng.random() < 0.2,
            "logprob_start_len": rng.choice([-1, 0]),
        }

    async def storm() -> list[str]:
        reasons: list[str] = []
        async with aiohttp.ClientSession() as gen_session, aiohttp.ClientSession() as ctl:

            async def one(i: int) -> None:
                req = body(i)
                async with gen_session.post(f"{engine.url}/generate", json=req) as resp:
                    assert resp.status == 200, await resp.text()
                    if req["stream"]:
                        assert (await resp.text()).rstrip().endswith("data: [DONE]")
                        return
                    out = await resp.json()
                outs = out if isinstance(out, list) else [out]
                assert len(outs) == req["sampling_params"]["n"]
                for o in outs:
                    assert len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"])
                    assert o["meta_info"]["completion_tokens"] == len(o["output_ids"])
                    reasons.append(o["meta_info"]["finish_reason"]["type"])

            async def control() -> None:
                for _ in range(30):
                    await asyncio.sleep(rng.random() * 0.1)
                    action = rng.choice(["abort", "pause", "reload"])
                    if action == "abort":
                        await (
                            await ctl.post(
                                f"{engine.url}/abort_request",
                                json={"rid": f"storm-{rng.randint(0, 299)}"},
                            )
                        ).read()
                    elif action == "pause":
                        mode = rng.choice(["abort", "in_place", "retract"])
                        await (
                            await ctl.post(f"{engine.url}/pause_generation", json={"mode": mode})
                        ).read()
                        await asyncio.sleep(0.02)
                        await (await ctl.post(f"{engine.url}/continue_generation", json={})).read()
                    else:
                        reload = {"model_path": str(long_model_dir), "weight_version": "0"}
                        async with ctl.post(
                            f"{engine.url}/update_weights_from_disk", json=reload
                        ) as resp:
                            assert resp.status == 200, await resp.text()

            await asyncio.gather(control(), *(one(i) for i in range(300)))
        return reasons

    reasons = asyncio.run(storm())
    assert set(reasons) <= {"stop", "length", "abort"} and len(reasons) > 300
    assert running(engine.url) == 0


def test_a_full_kv_cache_makes_new_sequences_wait_instead_of_growing(
    start_service, toy_model_dir: Path
) -> None:
    # the toy model's cache takes 512 bytes per position: 65600 bytes hold two rows of 63
    engine = start_service(
        "engine",
        [
            "engine",
            "--model",
            str(toy_model_dir),
            "--port",
            "0",
            "--kv-cache-gb",
            str(65600 / 2**30),
        ],
    )
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 59, "ignore_eos": True}}
    most = 0
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, engine.url, "/generate", body) for _ in range(6)]
        while not all(f.done() for f in futures):
            most = max(most, running(engine.url))
        results = [f.result().json() for f in futures]
    assert all(r["meta_info"]["completion_tokens"] == 59 for r in results)
    assert most <= 2
