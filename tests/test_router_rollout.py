"""The router process (real CLI) against two fake SGLang engines and a real Valkey server."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from proto import SampleGroup
from services.rollout_router.rollout.toy_task import reverse_digits_reward
from services.sample_buffer import SampleBuffer
from tests.helpers import free_port, get_json, post_json, read_all, wait_until
from tests.helpers import router_args as shared_router_args


def router_args(buffer: SampleBuffer, model: Path, urls: list[str], *extra: str) -> list[str]:
    return shared_router_args(buffer, model, urls, *extra, n=4)


def test_groups_arrive_in_redis_with_exact_tokens_and_rewards(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines().url, engines().url]
    router = start_service("router", router_args(buffer, toy_model_dir, urls))
    wait_until(lambda: buffer.depth() >= 8, "two batches of groups")
    groups = read_all(buffer)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(toy_model_dir))
    assert {g.group_id for g in groups} == {f"p{i}" for i in range(8)}, "draws of the cursor"
    assert len({g.prompt for g in groups}) == 8, "no prompt twice within an epoch"
    for group in groups:
        assert len(group.samples) == 4
        assert group.weight_version == 0
        for s in group.samples:
            assert s.prompt_ids == tokenizer(group.prompt)["input_ids"]
            assert len(s.response_ids) == len(s.response_logprobs) == len(s.loss_mask)
            assert s.loss_mask == [1] * len(s.response_ids)
            assert s.token_versions == [0] * len(s.response_ids)
            assert s.response_text == tokenizer.decode(s.response_ids, skip_special_tokens=True)
            stopped = s.finish_reason == "stop"
            assert s.reward == pytest.approx(
                reverse_digits_reward(s.response_text, group.label, stopped)
            )
        # The fake engine answers exactly on even samples and wrongly (no EOS) on odd ones.
        rewards = [s.reward for s in group.samples]
        assert rewards[0::2] == [1.0, 1.0] and all(r < 1.0 for r in rewards[1::2])
    workers = get_json(router.url + "/workers")["workers"]
    assert all(w["requests"] > 0 for w in workers), "least-outstanding used both engines"


def test_staleness_gate_holds_new_groups_until_the_trainer_consumes_or_engines_catch_up(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines().url, engines().url]
    # No held-out evaluation: at each new version it would compete with the rollout for the
    # engines (on a busy 2-core CI machine it delayed the groups past the wait below).
    router = start_service(
        "router",
        router_args(buffer, toy_model_dir, urls, "--max-staleness", "1", "--eval-interval", "0"),
    )
    # The gate closes once the 8th group starts (its sentence then says put 7); when that group
    # is put and ends, the loop reads the counters again and the sentence says put 8.
    waiting = (
        "the trainer to consume groups (put 8, consumed 0, trainer at version -1); no trainer "
        "has started on this run yet (one still loading its model, or one with another "
        "--run-id or --redis-url)"
    )
    status = wait_until(
        lambda: (
            (s := get_json(router.url + "/rollout/status"))["state"] == "waiting_for_trainer"
            and s["waiting_for"] == waiting
            and s
        ),
        f"the gate to close with every allowed group put ({waiting!r})",
    )
    # no trainer: engines and trainer at version 0 allow rollouts 0 and 1 (2 x 4 groups)
    assert status["batch"] == 2 and status["groups_put"] == 8
    assert {g.group_id for g in read_all(buffer)} == {f"p{i}" for i in range(8)}
    buffer.set_version("engines", 1)
    # Groups are streamed one by one, and each read returns only groups not read before:
    # collect across reads until rollout 2 is in, then check that it holds exactly 4 groups.
    groups: list[SampleGroup] = []

    def rollout_2_complete() -> bool:
        groups.extend(read_all(buffer))
        return len(groups) >= 4

    wait_until(rollout_2_complete, "rollout 2 after version:engines=1", timeout_s=90)
    status = wait_until(
        lambda: (
            (s := get_json(router.url + "/rollout/status"))["state"] == "waiting_for_trainer" and s
        ),
        "the gate to close again",
    )
    assert {g.group_id for g in groups} == {f"p{i}" for i in range(8, 12)}
    assert status["groups_put"] == 12 and status["engines_version"] == 1


def test_eval_and_rollout_metrics_are_published(buffer, toy_model_dir, start_service, engines):
    urls = [engines().url, engines().url]
    start_service("router", router_args(buffer, toy_model_dir, urls))

    def metrics() -> dict[str, tuple[int, dict]]:
        found = {}
        for _id, record in buffer.read_metrics():
            for key in record.values:
                found.setdefault(key, (record.step, record.values))
        return found

    found = wait_until(
        lambda: (m := metrics()) and "eval/accuracy" in m and "rollout/reward_mean" in m and m,
        "eval and rollout metrics",
    )
    step, values = found["eval/accuracy"]
    assert step == 0
    assert values["eval/accuracy"] == 1.0, "the fake engine answers greedy prompts exactly"
    assert values["eval/num_prompts"] == 20.0
    _step, rollout = found["rollout/reward_mean"]
    # exact on even samples, partly right on odd ones (a prompt like `3 3` earns 2/3 there)
    assert 0.5 <= rollout["rollout/reward_mean"] < 1.0
    assert rollout["rollout/batch"] == 0.0
    assert rollout["rollout/truncated_fraction"] == 0.5  # the odd samples run to the bound
    assert rollout["rollout/samples_per_s"] > 0


def test_an_engine_that_never_comes_up_fails_startup_naming_its_url(buffer, toy_model_dir, engines):
    dead = f"http://127.0.0.1:{free_port()}"
    args = router_args(buffer, toy_model_dir, [engines().url, dead], "--engine-wait-timeout-s", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert dead in last_line and "GET /model_info" in last_line


def test_requests_to_a_failing_engine_are_retried_on_the_other(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines("--fail-generate").url, engines().url]
    router = start_service(
        "router", router_args(buffer, toy_model_dir, urls, "--policy", "round_robin")
    )
    wait_until(lambda: buffer.depth() >= 8, "two batches despite the failing engine")
    status = get_json(router.url + "/rollout/status")
    assert status["retries"] > 0
    assert status["drops"] == {}
    assert len(read_all(buffer)) >= 8


def test_a_group_that_fails_on_every_engine_is_counted_as_a_drop(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines("--fail-generate").url, engines("--fail-generate").url]
    router = start_service("router", router_args(buffer, toy_model_dir, urls, "--max-retries", "1"))
    wait_until(lambda: buffer.drop_counts().get("engine_error", 0) >= 4, "drops of batch 0")
    assert buffer.depth() == 0
    assert get_json(router.url + "/rollout/status")["drops"]["engine_error"] >= 4
    # an engine failure is not the prompt's: it is drawn again, once (the drop log: newest first)
    p0 = wait_until(
        lambda: (
            (d := [d for d in buffer.drop_log(1000) if d.group_id == "p0"]) and len(d) >= 2 and d
        ),
        "p0 dropped twice",
    )
    assert len(p0) == 2 and all("HTTP 500" in d.detail for d in p0), p0
    assert [d.detail.endswith("its prompt is drawn again (once)") for d in p0] == [False, True]


def test_requests_the_engines_refuse_stop_the_loop_naming_their_message_without_backing_off(
    buffer, toy_model_dir, start_service, engines
):
    """HTTP 400 to every request (a setting each request carries that the engines refuse): the
    loop does not wait for the engines as if they were down, it stops after REFUSED_IN_A_ROW
    groups with the engine's message, and /health says it (tandem up then stops with it)."""
    from services.rollout_router.rollout.loop import REFUSED_IN_A_ROW

    urls = [engines("--fail-generate", "400").url, engines("--fail-generate", "400").url]
    router = start_service("router", router_args(buffer, toy_model_dir, urls))
    health = wait_until(
        lambda: (r := httpx.get(router.url + "/health")).status_code == 503 and r.json(),
        "the loop to stop",
    )
    # (groups run concurrently: others may fail between the bound and the stop, so >=)
    counted = re.search(r"refused the requests of (\d+) groups in a row", health["error"])
    assert counted and int(counted.group(1)) >= REFUSED_IN_A_ROW, health["error"]
    assert "injected refusal of the request" in health["error"]
    assert "a setting every request carries is wrong" in health["error"]
    assert buffer.drop_counts()["engine_error"] >= REFUSED_IN_A_ROW


def test_router_answers_generate_like_an_engine_and_stops_cleanly_on_sigterm(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines().url, engines().url]
    greedy = ("--rollout-temperature", "0")  # (said at the start: groups of one response)
    router = start_service(
        "router", router_args(buffer, toy_model_dir, urls, "--no-rollout", *greedy)
    )
    body = {"input_ids": [1, 4, 5, 14], "sampling_params": {"n": 3, "max_new_tokens": 4}}
    outs = post_json(router.url + "/generate", body)
    assert [o["output_ids"] for o in outs] == [[5, 4, 2], [4, 5, 5, 5], [5, 4, 2]]
    assert get_json(router.url + "/get_model_info")["weight_version"] == "0"
    status = get_json(router.url + "/rollout/status")
    assert (status["state"], status["running"]) == ("rollouts off", False), (
        "--no-rollout: not started"
    )
    assert "--no-rollout" in status["waiting_for"]
    router.stop()
    assert router.proc.returncode == 0
    assert "router stopped: tasks cancelled" in router.log()
    assert "Traceback" not in router.log()
    assert "--rollout-temperature 0.0 --rollout-top-k -1 samples greedily: the " in (router.log())


def test_rollout_waits_while_the_buffer_is_full_and_goes_on_when_the_trainer_consumes(
    buffer, toy_model_dir, start_service, engines
):
    urls = [engines().url]
    args = router_args(buffer, toy_model_dir, urls, "--max-staleness", "1000")
    args[args.index("--max-buffer-depth") + 1] = "6"
    router = start_service("router", args)
    # One read for both: the state turns to waiting_for_buffer when the loop next tries to
    # start a group, a moment after the 6th put that made the buffer full.
    wait_until(
        lambda: (
            (s := get_json(router.url + "/rollout/status"))["state"] == "waiting_for_buffer"
            and s["waiting"] == "buffer full (depth 6 of 6)"
        ),
        "the full buffer to hold the rollout (state waiting_for_buffer)",
    )
    assert buffer.depth() == 6
    entries = buffer.read_groups("trainer-1", 2, block_ms=None)  # 2 entries: 2 groups or more
    buffer.ack([entry_id for entry_id, _g in entries])
    buffer.incr_counter("groups_consumed", len(entries))  # what the trainer counts after training
    wait_until(
        lambda: get_json(router.url + "/rollout/status")["groups_put"] == 6 + len(entries),
        "as many groups more",
    )
    assert buffer.depth() == 6


def test_a_redis_outage_pauses_rollout_counts_the_lost_groups_and_rollout_resumes(
    toy_model_dir, start_service, engines, tmp_path
):
    from services.sample_buffer import BufferConfig, RedisServer

    # A server with its append-only file, restarted on it: the run's state survives the outage
    # (one restarted empty is a lost store, which stops the run: tests/test_store_faults.py).
    first = RedisServer(log_dir=tmp_path / "r1", data_dir=tmp_path / "data").start()
    port = first.port
    buffer = SampleBuffer(BufferConfig(redis_url=first.url, run_id="outage"))
    urls = [engines("--delay-ms", "300").url]
    router = start_service(
        "router",
        router_args(buffer, toy_model_dir, urls, "--max-staleness", "1000", "--eval-interval", "0"),
    )
    wait_until(lambda: buffer.depth() >= 4, "groups before the outage")
    put_before = buffer.counters().get("groups_put", 0)
    first.stop()
    status = wait_until(
        lambda: (
            (s := get_json(router.url + "/rollout/status"))["state"] == "waiting_for_redis" and s
        ),
        "the loop to notice",
    )
    assert status["buffer_depth"] is None and "Error" in status["error"]
    second = RedisServer(port=port, log_dir=tmp_path / "r2", data_dir=tmp_path / "data").start()
    try:
        wait_until(
            lambda: (
                buffer.counters().get("groups_put", 0) >= put_before + 4
                and buffer.drop_counts().get("redis_unavailable", 0) > 0
            ),
            "new groups, and the interrupted ones counted, after Redis is back",
        )
        lost = buffer.drop_counts().get("redis_unavailable", 0)
        assert 0 < lost <= 4, "the interrupted batch's missing groups"
        assert get_json(router.url + "/rollout/status")["state"] != "failed"
    finally:
        router.stop()
        second.stop()


def test_a_redis_refusing_writes_holds_the_rollout_with_the_fix_until_it_takes_them(
    buffer, toy_model_dir, start_service, engines
):
    """A Redis whose disk is full answers PING but refuses every write (MISCONF; here OOM at a
    maxmemory of 1 byte, the same kind of refusal): the rollout waited on PING, which such a
    server answers, and its status named no cause."""
    urls = [engines("--delay-ms", "100").url]
    router = start_service(
        "router",
        router_args(buffer, toy_model_dir, urls, "--max-staleness", "1000", "--eval-interval", "0"),
    )
    wait_until(lambda: buffer.depth() >= 2, "groups before the refusal")
    buffer.redis.config_set("maxmemory", 1)
    try:
        status = wait_until(
            lambda: (
                (s := get_json(router.url + "/rollout/status"))["state"] == "waiting_for_redis"
                and s
            ),
            "the loop to notice",
        )
        assert "it is at its maxmemory: raise maxmemory" in status["waiting_for"], status
        time.sleep(2)  # no group starts while no write goes through
        held = get_json(router.url + "/rollout/status")
        assert held["state"] == "waiting_for_redis", held
    finally:
        buffer.redis.config_set("maxmemory", 0)
    before = buffer.depth()
    wait_until(lambda: buffer.depth() >= before + 2, "groups once Redis takes writes")
    lost = buffer.drop_counts().get("redis_unavailable", 0)
    assert 0 < lost <= 4 * 8, "the groups in flight at the refusal, once each"


def test_stop_strings_and_stop_token_ids_end_samples_on_the_real_engine_with_exact_tokens(
    buffer, toy_model_dir, start_service
):
    """The reference engine runs the toy model: `5` (token 9) is a stop string and `9`
    (token 13) a stop token id; a sample ends on the first of either, keeps it as its last
    token and at the end of its text, and its ids, log-probs and mask line up."""
    from transformers import AutoTokenizer

    engine = start_service("engine", ["engine", "--model", str(toy_model_dir), "--port", "0"])
    args = router_args(
        buffer,
        toy_model_dir,
        [engine.url],
        "--rollout-stop",
        "5",
        "--rollout-stop-token-ids",
        "13",
        "--rollout-max-response-len",
        "12",
        "--eval-interval",
        "0",
    )
    router = start_service("router", args)
    wait_until(lambda: buffer.depth() >= 8, "two batches from the reference engine")
    tokenizer = AutoTokenizer.from_pretrained(str(toy_model_dir))
    samples = [s for g in read_all(buffer) for s in g.samples]
    ends: dict[str, int] = {"string": 0, "token_id": 0, "eos": 0, "length": 0}
    for s in samples:
        n = len(s.response_ids)
        assert n == len(s.response_logprobs) == len(s.loss_mask) == len(s.token_versions)
        assert s.loss_mask == [1] * n and all(lp <= 0.0 for lp in s.response_logprobs)
        assert s.response_text == tokenizer.decode(s.response_ids, skip_special_tokens=True)
        assert 9 not in s.response_ids[:-1] and 13 not in s.response_ids[:-1], "ends at the first"
        assert 2 not in s.response_ids[:-1]
        last = s.response_ids[-1]
        if last == 9:
            assert s.finish_reason == "stop" and s.response_text.endswith("5")
            ends["string"] += 1
        elif last == 13:
            assert s.finish_reason == "stop" and s.response_text.endswith("9")
            ends["token_id"] += 1
        elif last == 2:
            assert s.finish_reason == "stop"
            ends["eos"] += 1
        else:
            assert s.finish_reason == "length" and n == 12
            ends["length"] += 1
    assert ends["string"] > 0 and ends["token_id"] > 0, ends
    # The engine reports the matched stop string; the router forwards it as is.
    for seed in range(20):
        body = {
            "input_ids": [1, 5, 6, 14],
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 12,
                "stop": ["5"],
                "no_stop_trim": True,
                "sampling_seed": seed,
            },
        }
        out = post_json(router.url + "/generate", body)
        if out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "5"}:
            assert out["output_ids"][-1] == 9 and out["text"].endswith("5")
            assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
            break
    else:
        raise AssertionError("no seed of 20 stopped on the stop string")


def test_a_sample_text_ends_where_its_matched_stop_string_ends():
    from services.rollout_router.samples import Partial

    def out(text: str, reason: dict) -> dict:
        return {"text": text, "meta_info": {"finish_reason": reason, "output_token_logprobs": []}}

    # one token `5=>` reached past the stop string `=`: SGLang keeps the text up to its end
    assert Partial.of(out("125=>", {"type": "stop", "matched": "="})).text == "125="
    assert Partial.of(out("12", {"type": "stop", "matched": 2})).text == "12"
    assert Partial.of(out("12>", {"type": "length", "length": 3})).text == "12>"
    assert Partial.of(out("12", {"type": "stop", "matched": "="})).text == "12", "not in text"
