"""The rollout control API of the router process: start, pause, resume, stop, config, token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from proto.contract import SampleLimits, ServiceStatus
from services.sample_buffer import SampleBuffer
from tandem.watchdog import Watchdog
from tests.helpers import router_args as shared_router_args
from tests.helpers import wait_until

JSON = "application/json"
TOKEN = {"Authorization": "Bearer t0ken"}


def router_args(buffer: SampleBuffer, model: Path, urls: list[str], *extra: str) -> list[str]:
    flags = ["--no-rollout", "--max-staleness", "1000", "--api-token", "t0ken", *extra]
    return shared_router_args(buffer, model, urls, *flags, max_buffer_depth=100000)


def status(router) -> dict:
    return httpx.get(router.url + "/rollout/status").json()


def test_rollout_starts_pauses_resumes_and_stops_on_request(
    buffer, toy_model_dir, start_service, engines
):
    engine = engines()
    router = start_service("router", router_args(buffer, toy_model_dir, [engine.url]))
    assert status(router)["running"] is False and buffer.depth() == 0
    assert router.log().count(f"admitted {engine.url} ") == 1  # (said twice: a first wait too)
    assert httpx.post(router.url + "/rollout/start").status_code == 401
    assert httpx.post(router.url + "/rollout/start", headers=TOKEN).json() == {"running": True}
    wait_until(lambda: buffer.depth() >= 8, "groups after start")
    httpx.post(router.url + "/rollout/pause", headers=TOKEN)
    paused = wait_until(lambda: (s := status(router))["state"] == "paused" and s, "pause")
    depths = {buffer.depth() for _ in range(20)}
    assert depths == {paused["groups_put"]}, "no groups while paused"
    # tandem up's watchdog: a pause on request is no stall (it ended the run at --stall-fail-s)
    said: list[str] = []
    watchdog = Watchdog(buffer, {}, stall_warn_s=0.2, stall_fail_s=0.4, say=said.append)
    assert held_through(watchdog, buffer, "paused") == ["", "", "", "", "", "", "", ""]
    assert said[0].startswith("rollout paused on request: the run waits for POST /rollout/resume")
    assert re.fullmatch(r"rollout paused on request for \d+ s: POST /rollout/resume.*", said[-1])
    httpx.post(router.url + "/rollout/resume", headers=TOKEN)
    wait_until(lambda: buffer.depth() > paused["groups_put"], "groups after resume")
    wait_until(lambda: look(watchdog) is not None and watchdog.held_since == 0, "the watchdog")
    assert re.fullmatch(r"rollout goes on after \d+ s held on request", said[-1])
    assert httpx.post(router.url + "/rollout/stop", headers=TOKEN).json() == {"running": False}
    stopped = status(router)
    assert stopped["running"] is False and stopped["state"] == "stopped"
    # (what tandem up's no-progress report shows: the old code said nothing, "is not waiting")
    assert stopped["waiting_for"] == "POST /rollout/start (rollout was stopped on request)"
    assert held_through(watchdog, buffer, "stopped") == [""] * 8
    assert said[-1].startswith("rollout stopped on request")


def test_the_watchdogs_wait_for_progress_starts_when_a_hold_on_request_ends(
    buffer: SampleBuffer,
) -> None:
    """Looks further apart than --stall-warn-s (a loaded machine): the look that sees the pause
    end said the run had made no progress since the look before, while it was held."""
    said: list[str] = []
    watchdog = Watchdog(buffer, {}, stall_warn_s=0.2, stall_fail_s=0.4, say=said.append)
    paused = ServiceStatus(role="router", state="paused", waiting_for="POST /rollout/resume")
    buffer.set_status(paused)
    assert look(watchdog) == ""
    time.sleep(0.5)  # past --stall-fail-s
    buffer.set_status(ServiceStatus(role="router", state="generating"))
    assert look(watchdog) == "", "the old code ended the run here"
    assert re.fullmatch(r"rollout goes on after \d+ s held on request", said[-1]), said
    time.sleep(0.25)
    assert look(watchdog) == ""
    assert [line for line in said if line.startswith("no progress for 0 s")], said


def held_through(watchdog: Watchdog, buffer: SampleBuffer, state: str) -> list[str]:
    """The watchdog's checks over twice its --stall-fail-s, the router's status `state`."""
    wait_until(lambda: buffer.statuses()["router"].state == state, f"the {state} status")
    problems = []
    for _ in range(8):
        problems.append(look(watchdog))
        time.sleep(0.1)
    return problems


def look(watchdog: Watchdog) -> str:
    watchdog.last_health_at = 0.0  # do not wait out the interval
    return watchdog.check()


def test_stopping_mid_batch_counts_the_groups_in_flight_as_cancelled(
    buffer, toy_model_dir, start_service, engines
):
    router = start_service(
        "router", router_args(buffer, toy_model_dir, [engines("--delay-ms", "60000").url])
    )
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    # the 4 groups drawn (in flight in Redis), not 4 requests (an evaluation's count there too)
    wait_until(lambda: buffer.counters().get("prompts_drawn") == 4, "batch 0 in flight")
    httpx.post(router.url + "/rollout/stop", headers=TOKEN)
    assert buffer.drop_counts() == {"cancelled": 4}
    assert buffer.depth() == 0
    # Their prompts were given back: the next start draws them again, not new ones.
    assert buffer.counters()["prompts_drawn"] == 4
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    # (the status's in-flight count can still be the stopped batch's: wait for the draws too)
    wait_until(
        lambda: buffer.redis.zcard(buffer.redraw_key) == 0 and status(router)["in_flight"] >= 4,
        "the 4 given-back prompts drawn and in flight again",
    )
    assert buffer.counters()["prompts_drawn"] == 4


def detail(resp: httpx.Response) -> str:
    """A refusal's detail as text: a sentence of the router's, or FastAPI's list of field
    errors (each naming its field in `loc`)."""
    said = resp.json()["detail"]
    return said if isinstance(said, str) else json.dumps(said)


def test_patching_the_config_validates_and_changes_later_requests(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url]))
    url = router.url + "/rollout/config"
    assert httpx.patch(url, json={"rollout_max_response_len": 2}).status_code == 401
    for bad, words in [
        ({"rollout_temperature": "hot"}, '"rollout_temperature"], "msg": "Input should be a valid'),
        ({"rollout_top_p": 0}, '"rollout_top_p"], "msg": "Input should be greater than 0"'),
        # an engine answers 400 to each request with it (SGLang's rule): refused here
        ({"rollout_top_k": 0}, '"rollout_top_k"], "msg": "must be at least 1, or -1 (all)"'),
        # 0, the task's length, is resolved at the start: a live length is at least 1
        ({"rollout_max_response_len": 0}, '"rollout_max_response_len"], "msg": "Input should be'),
        # the trainer scores the whole distribution: a filtered one would not be the engines'
        ({"rollout_top_p": 0.9}, "--rollout-top-p 0.9: rollouts are trained on"),
        ({"rollout_top_k": 20}, "--rollout-top-k 20: rollouts are trained on"),
        ('{"rollout_temperature": 1e400}', "a finite number"),  # JSON's number past a float
        ({"model": "/elsewhere"}, '"model"], "msg": "Extra inputs are not permitted"'),
        ({"no_such_field": 1}, '"no_such_field"], "msg": "Extra inputs are not permitted"'),
        # started without a reward: a dataset would be scored by the toy task's verifier
        ({"prompt_data": str(tmp_path / "d.jsonl")}, "choose how its responses are scored"),
        ({"rollout_max_response_len": 2, "rollout_max_concurrency": -1}, "concurrency"),
    ]:
        if isinstance(bad, str):
            resp = httpx.patch(url, content=bad, headers={**TOKEN, "content-type": JSON})
        else:
            resp = httpx.patch(url, json=bad, headers=TOKEN)
        assert resp.status_code == 422 and words in detail(resp), (bad, detail(resp))
    # the run's terms are no field of the body's type: the trainer relies on them
    for term in ("rollout_batch_size", "n_samples_per_prompt", "max_staleness", "seed"):
        for value in (8, 0, "4"):
            resp = httpx.patch(
                url, json={"rollout_max_response_len": 2, term: value}, headers=TOKEN
            )
            said = f'"{term}"], "msg": "Extra inputs are not permitted"'
            assert resp.status_code == 422 and said in detail(resp), (term, detail(resp))
    body = httpx.get(router.url + "/openapi.json").json()["components"]["schemas"]["RolloutPatch"]
    assert "rollout_temperature" in body["properties"] and body["additionalProperties"] is False
    assert "rollout_batch_size" not in body["properties"]
    assert body["properties"]["rollout_max_response_len"]["anyOf"][0]["minimum"] == 1
    assert httpx.get(url).json()["rollout_max_response_len"] == 4, (
        "a rejected patch changes nothing"
    )
    new = httpx.patch(
        url,
        json={
            "rollout_max_response_len": 2,
            "rollout_max_concurrency": 2,
            "rollout_temperature": 0.7,
        },
        headers=TOKEN,
    )
    assert new.status_code == 200
    assert new.json()["rollout_max_response_len"] == 2 and new.json()["rollout_temperature"] == 0.7
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    wait_until(lambda: buffer.depth() >= 4, "groups")
    groups = [g for _id, g in buffer.read_groups("t", 100, block_ms=None)]
    assert all(len(s.response_ids) <= 2 for g in groups for s in g.samples)
    assert {s.temperature for g in groups for s in g.samples} == {0.7}  # what the trainer applies
    assert any(s.finish_reason == "length" for g in groups for s in g.samples)
    # greedy rollouts are taken, and said: a group of one response teaches a GRPO trainer nothing
    greedy = httpx.patch(url, json={"rollout_temperature": 0}, headers=TOKEN)
    assert greedy.status_code == 200 and greedy.json()["rollout_temperature"] == 0
    said = "PATCH /rollout/config: --rollout-temperature 0.0 --rollout-top-k -1 samples greedily"
    wait_until(lambda: said in router.log(), "the greedy note in the router's log")


def test_openapi_docs_list_the_control_routes(buffer, toy_model_dir, start_service, engines):
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url]))
    assert httpx.get(router.url + "/docs").status_code == 200
    paths = httpx.get(router.url + "/openapi.json").json()["paths"]
    for path in (
        "/rollout/start",
        "/rollout/pause",
        "/rollout/resume",
        "/rollout/stop",
        "/rollout/status",
        "/rollout/config",
        "/workers",
        "/generate",
    ):
        assert path in paths


def test_patching_the_dataset_switches_the_prompts_of_later_batches(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    data = tmp_path / "digits.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "99>", "label": "99"}) for _ in range(3)))
    scored_by = router_args(buffer, toy_model_dir, [engines().url], "--rm-type", "reverse_digits")
    router = start_service("router", scored_by)
    patch = {"prompt_data": str(data), "rm_type": "exact_match"}
    resp = httpx.patch(router.url + "/rollout/config", json=patch, headers=TOKEN)
    assert resp.status_code == 422 and "rm_type" in detail(resp), "rewards are fixed"
    missing = {"prompt_data": str(tmp_path / "missing.jsonl")}
    resp = httpx.patch(router.url + "/rollout/config", json=missing, headers=TOKEN)
    assert resp.status_code == 422 and "no such file" in resp.json()["detail"]
    resp = httpx.patch(
        router.url + "/rollout/config", json={"prompt_data": str(data)}, headers=TOKEN
    )
    assert resp.status_code == 200 and resp.json()["prompt_data"] == str(data)
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    wait_until(lambda: buffer.depth() >= 4, "groups")
    groups = [g for _id, g in buffer.read_groups("t", 100, block_ms=None)]
    assert {g.prompt for g in groups} == {"99>"}


def test_a_router_without_engines_waits_for_one_instead_of_dropping(
    buffer, toy_model_dir, start_service, engines
):
    router = start_service("router", router_args(buffer, toy_model_dir, []))
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    wait_until(lambda: status(router)["state"] == "waiting_for_workers", "the wait")
    httpx.post(router.url + "/workers", json={"url": engines().url}, headers=TOKEN)
    wait_until(lambda: buffer.depth() >= 4, "groups once an engine is added")
    assert buffer.drop_counts() == {}
    # the evaluation at version 0 waited for the engine too, rather than failing every prompt
    evals = wait_until(
        lambda: [r.values for _id, r in buffer.read_metrics() if "eval/failed" in r.values],
        "an evaluation",
    )
    assert evals[0]["eval/failed"] == 0 and evals[0]["eval/num_prompts"] == 20, evals


def test_a_rollout_waiting_for_engines_says_which_was_refused_for_its_context(
    buffer, toy_model_dir, start_service, engines
):
    router = start_service("router", router_args(buffer, toy_model_dir, []))
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    short = engines("--context-length", "4")  # the response bound is 4 (router_args)
    reply = httpx.post(router.url + "/workers", json={"url": short.url}, headers=TOKEN)
    assert reply.json()["status"] == "refused", reply.text
    expected = (
        f"an admitted engine (none is healthy: see GET /workers; refused: engine {short.url} "
        "has a context length of 4 tokens (its /server_info), which cannot hold a response of "
        "--rollout-max-response-len 4 and a prompt: start the engine with --context-length "
        "above 4, or lower --rollout-max-response-len below 4)"
    )
    wait_until(lambda: status(router)["waiting_for"] == expected, "the refusal in the status")
    # what tandem up's watchdog reads
    wait_until(lambda: buffer.statuses()["router"].waiting_for == expected, "the status record")
    assert buffer.depth() == 0 and buffer.drop_counts() == {}


def test_a_patch_making_samples_longer_than_the_trainer_takes_is_refused_naming_its_flags(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1" * 40 + ">", "label": "1"}) + "\n")
    scored_by = router_args(buffer, toy_model_dir, [engines().url], "--rm-type", "exact_match")
    router = start_service("router", scored_by)
    url = router.url + "/rollout/config"
    # no trainer has stated its limits yet: nothing to hold the patch to
    assert httpx.patch(url, json={"rollout_max_response_len": 30}, headers=TOKEN).status_code == 200
    buffer.set_limits(SampleLimits(max_tokens=24, max_response_len=16))  # as a trainer does
    resp = httpx.patch(url, json={"rollout_max_response_len": 20}, headers=TOKEN)
    assert resp.status_code == 422
    assert resp.json()["detail"].startswith(
        "rollout_max_response_len 20: the trainer takes responses of at most 16 tokens (its "
        "--max-response-len): the longer ones would be dead-lettered as too_long"
    )
    # the toy task's prompts are 4 tokens (with BOS): 4 + 16 fits 24
    resp = httpx.patch(url, json={"rollout_max_response_len": 16}, headers=TOKEN)
    assert resp.status_code == 200, resp.text
    resp = httpx.patch(url, json={"prompt_data": str(data)}, headers=TOKEN)
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert "samples may reach 58 tokens (the longest prompt, 42, and responses up to 16)" in detail
    assert "lower rollout_max_response_len" not in detail, "the prompt alone is too long"
    assert "restart the trainer with --max-tokens-per-gpu 57" in detail
    assert httpx.get(url).json()["prompt_data"] == "", "a refused patch changes nothing"
    buffer.set_limits(SampleLimits(max_tokens=50, max_response_len=100))
    resp = httpx.patch(url, json={"prompt_data": str(data)}, headers=TOKEN)
    assert "lower rollout_max_response_len to 8, or restart" in resp.json()["detail"]
    # the router cuts each request at the model's 64 positions: samples stop there
    buffer.set_limits(SampleLimits(max_tokens=64, max_response_len=100))
    resp = httpx.patch(
        url, json={"prompt_data": str(data), "rollout_max_response_len": 90}, headers=TOKEN
    )
    assert resp.status_code == 200, resp.text


def test_engines_paused_through_the_router_hold_the_rollout_and_its_status_says_how_to_resume(
    buffer, toy_model_dir, start_service, engines
):
    """A pause through the router paused every engine, and the rollout went on sending groups
    whose requests waited or came back aborted (dropped after 4 tries): the run stalled with no
    word of the pause."""
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url]))
    httpx.post(router.url + "/rollout/start", headers=TOKEN)
    wait_until(lambda: buffer.depth() >= 4, "groups")
    assert httpx.post(router.url + "/pause_generation", json={}, headers=TOKEN).is_success

    def held() -> dict | None:
        s = status(router)
        return s if s["state"] == "waiting_for_workers" else None

    paused = wait_until(held, "the rollout waits for the engines", 30)
    assert paused["waiting_for"].startswith("the engines, paused through POST /pause_generation")
    assert "POST /continue_generation (with the API token) resumes them" in paused["waiting_for"]
    drawn = buffer.counters()["prompts_drawn"]
    time.sleep(1.0)  # (the groups in flight wait at the engines)
    assert buffer.counters()["prompts_drawn"] == drawn, "no group started"
    assert status(router)["in_flight"] <= paused["in_flight"]
    assert httpx.post(router.url + "/continue_generation", json={}, headers=TOKEN).is_success
    wait_until(lambda: status(router)["state"] != "waiting_for_workers", "the rollout going on")
    wait_until(lambda: buffer.counters()["prompts_drawn"] > drawn, "new groups after continue")


def test_a_patch_of_a_response_bound_the_engines_context_cannot_hold_is_refused_naming_it(
    buffer, toy_model_dir, start_service, engines
):
    engine = engines("--context-length", "20")
    router = start_service("router", router_args(buffer, toy_model_dir, [engine.url]))
    url = router.url + "/rollout/config"
    resp = httpx.patch(url, json={"rollout_max_response_len": 20}, headers=TOKEN)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"] == (
        f"rollout_max_response_len 20: engine {engine.url} has a context length of 20 tokens "
        "(its /server_info), which cannot hold such a response and a prompt: give less than "
        "20, or restart the engine with a higher --context-length"
    )
    assert httpx.get(url).json()["rollout_max_response_len"] == 4, "a refused patch changes nothing"
    resp = httpx.patch(url, json={"rollout_max_response_len": 19}, headers=TOKEN)
    assert resp.status_code == 200 and resp.json()["rollout_max_response_len"] == 19, resp.text


def test_a_router_asked_for_filtered_rollouts_exits_2_naming_the_flag(
    buffer, engines, toy_model_dir
):
    args = router_args(buffer, toy_model_dir, [engines().url], "--rollout-top-p", "0.9")
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem router: start-up failed: --rollout-top-p 0.9: rollouts are "), (
        last
    )
