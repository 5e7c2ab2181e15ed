"""Never stuck, never silent (router side): the router refills what the trainer drops, waits
out a late dependency with backoff, survives failing rewards, states its run contract, says
what it waits for, and reports a dead task on /health. Real router process (or app), stand-in
engines, a real Valkey server; the test itself plays the trainer and the broker where needed."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import httpx
import pytest

from proto.contract import RunContract
from tests.helpers import free_port, get_json, read_all, wait_until
from tests.test_router_agents import ScriptedEnv
from tests.test_router_rollout import router_args

FLAKY_REWARDS = '''
import itertools

calls = itertools.count()


def flaky(text, label, stopped):
    """Of every 4 calls: one raises, one returns None, one NaN, one 1.0."""
    k = next(calls) % 4
    if k == 0:
        raise ZeroDivisionError("boom")
    return [None, float("nan"), 1.0][k - 1]


def broken(text, label, stopped):
    raise ValueError("always")
'''


def test_a_trainer_that_drops_groups_gets_replacements_until_its_steps_complete(
    buffer, toy_model_dir, start_service, engines
):
    """The test trains: it consumes groups, drops every third one (as a staleness or length
    filter would), steps after 4 trained groups and brings the engines along (the broker's
    part). With max_staleness 0 a router that made exactly 4 groups per step waited forever."""
    urls = [engines().url]
    args = router_args(buffer, toy_model_dir, urls, "--max-staleness", "0", "--eval-interval", "0")
    start_service("router", args)
    version, trained, consumed = 0, 0, 0
    deadline = time.monotonic() + 60
    while version < 5:
        assert time.monotonic() < deadline, f"stuck at version {version}, {trained} trained"
        for entry_id, _group in buffer.read_groups("trainer", 16, block_ms=200):
            consumed += 1
            trained += consumed % 3 != 0
            buffer.set_counter("groups_consumed", consumed)
            buffer.ack([entry_id])
            if trained == 4:
                version, trained = version + 1, 0
                buffer.set_version("trainer", version)
                buffer.set_version("engines", version)
                if version == 5:
                    break
    assert consumed == 29, "20 trained and 9 dropped, each drop replaced by the router"
    assert buffer.counters()["groups_put"] >= consumed


def test_an_environment_that_comes_up_late_is_retried_with_backoff_and_groups_flow(
    buffer, chat_model_dir, start_service, engines
):
    from tests.test_router_agents import router_args as agent_args

    port = free_port()
    env_url = f"http://127.0.0.1:{port}"
    router = start_service(
        "router", agent_args(buffer, chat_model_dir, [engines().url], "--env-url", env_url)
    )
    status = wait_until(
        lambda: (s := get_json(router.url + "/rollout/status"))["state"] == "backing_off" and s,
        "the router to back off",
    )
    assert status["waiting_for"].startswith(f"environment {env_url}: ")
    assert "env_all_failed in a row" in status["waiting_for"]
    record = wait_until(
        lambda: (r := buffer.statuses().get("router")) and r.state == "backing_off" and r,
        "the status record to say so",
    )
    assert record.pid == router.proc.pid and env_url in record.waiting_for
    time.sleep(5)
    server = ThreadingHTTPServer(("127.0.0.1", port), type("Env", (ScriptedEnv,), {"turns": {}}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_until(lambda: buffer.depth() >= 4, "groups once the environment is up", 60)
        assert buffer.drop_counts()["env_all_failed"] >= 2
        assert get_json(router.url + "/rollout/status")["state"] != "backing_off"
        # the environment's outage was not the prompts': the first draw, dropped while it was
        # down, was given back (once: a later failure of it, a probe's, is its last) and drawn
        # again (the drop log: newest first)
        p0 = [
            d.detail.endswith("its prompt is drawn again (once)")
            for d in buffer.drop_log(1000)
            if d.group_id == "p0"
        ]
        assert p0[-1] and not any(p0[:-1]), p0
        assert len(p0) == 2 or "p0" in {group.group_id for group in read_all(buffer)}, p0
    finally:
        server.shutdown()


@pytest.fixture
def chat_model_dir(toy_model_dir, tmp_path_factory):
    from tests.helpers import with_chat_template
    from tests.test_router_agents import CHAT_TEMPLATE

    return with_chat_template(toy_model_dir, tmp_path_factory.mktemp("c") / "m", CHAT_TEMPLATE)


def test_an_evaluation_whose_every_prompt_failed_reports_no_accuracy(
    buffer, toy_model_dir, start_service, engines, tmp_path, monkeypatch
):
    """A reward that always raises: the evaluation publishes how many failed and no
    accuracy (an accuracy of 0.0 over no prompt read as a measured one)."""
    (tmp_path / "flaky_rewards.py").write_text(FLAKY_REWARDS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{sys.path[0]}")
    extra = ("--custom-rm-path", "flaky_rewards:broken", "--rm-max-errors-in-a-row", "0")
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url], *extra))
    evals = wait_until(
        lambda: [r.values for _id, r in buffer.read_metrics() if "eval/failed" in r.values],
        "an evaluation",
    )
    assert evals[0] == {"eval/num_prompts": 0.0, "eval/failed": 20.0}
    last = httpx.get(router.url + "/rollout/status").json()["last_eval"]
    assert "eval/accuracy" not in last


def test_rewards_that_raise_return_none_or_nan_drop_their_samples_and_groups_keep_coming(
    buffer, toy_model_dir, start_service, engines, tmp_path, monkeypatch
):
    (tmp_path / "flaky_rewards.py").write_text(FLAKY_REWARDS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{sys.path[0]}")
    args = router_args(
        buffer,
        toy_model_dir,
        [engines().url],
        "--custom-rm-path",
        "flaky_rewards:flaky",
        "--rm-workers",
        "0",  # in the router's process: the function counts every call of the run
        "--max-staleness",
        "1000",
    )
    router = start_service("router", args)
    wait_until(lambda: buffer.depth() >= 8, "groups despite the failing rewards")
    evals = wait_until(
        lambda: [r.values for _id, r in buffer.read_metrics() if "eval/failed" in r.values],
        "an evaluation despite the failing rewards",
    )
    assert evals[0]["eval/failed"] >= 10 and evals[0]["eval/num_prompts"] <= 10
    groups = read_all(buffer)
    assert all([s.reward for s in g.samples] == [1.0] for g in groups), "the one good sample"
    drops = buffer.drop_counts("samples")  # one sample of each group is put
    assert buffer.drop_counts() == {}
    assert drops["reward_error"] >= 2 * 8 and drops["reward_nonfinite"] >= 8
    assert set(drops) == {"reward_error", "reward_nonfinite"}
    assert any(
        d.group_id.endswith("-s2") and "returned nan" in d.detail for d in buffer.drop_log(100)
    )
    assert get_json(router.url + "/rollout/status")["state"] != "failed"
    assert get_json(router.url + "/health")["status"] == "ok", "the evaluation task lives"
    log = router.log()
    assert "Traceback" not in log
    assert log.count("raised ZeroDivisionError: boom") == 1, "the first error's text, once"


HANGS_ONCE = """
import os
import time


def once(text, label, stopped):
    \"\"\"The first call of the run hangs (its marker file made), every other returns 1.0.\"\"\"
    try:
        os.close(os.open(os.environ["HANG_MARKER"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 1.0
    time.sleep(3600)
"""


def test_a_reward_function_that_hangs_drops_its_sample_and_the_router_goes_on(
    buffer, toy_model_dir, start_service, engines, tmp_path, monkeypatch
):
    """A --custom-rm-path function runs in worker processes (--rm-workers): a call that hangs
    holds up neither the router's API nor the other rollouts, and its sample is dropped once
    --rm-timeout-s has passed."""
    (tmp_path / "hangs_once.py").write_text(HANGS_ONCE)
    marker = tmp_path / "hung"
    monkeypatch.setenv("HANG_MARKER", str(marker))
    args = router_args(
        buffer,
        toy_model_dir,
        [engines().url],
        "--custom-rm-path",
        f"{tmp_path / 'hangs_once.py'}:once",
        "--rm-timeout-s",
        "5",
        "--eval-interval",
        "0",  # the hanging call is a rollout's (an evaluation's failure is no drop)
        "--max-staleness",
        "1000",
    )
    router = start_service("router", args)
    wait_until(marker.exists, "the hanging call")
    started = time.monotonic()
    assert get_json(router.url + "/health")["status"] == "ok"
    assert time.monotonic() - started < 2, "the router answered while the function hung"
    # where the groups in flight are: the status says the function holds one (a stalled run's
    # diagnosis prints it)
    busy = re.compile(
        r"\d+ groups in flight: \d+ requests at the engines; \d+ calls to reward function once "
        r"in flight \(the oldest [1-5] s; --rm-timeout-s 5, \d+ --rm-workers\)"
    )
    wait_until(lambda: busy.fullmatch(get_json(router.url + "/rollout/status")["busy"]), "busy")
    wait_until(lambda: buffer.drop_counts("samples").get("reward_error") == 1, "its drop", 60)
    wait_until(lambda: buffer.depth() >= 8, "groups after it")
    [drop] = [d for d in buffer.drop_log(100) if d.reason == "reward_error"]
    assert drop.detail == (
        "reward function once did not return within 5s (--rm-timeout-s): its worker process "
        "was killed and is replaced"
    )
    assert all(s.reward == 1.0 for g in read_all(buffer) for s in g.samples)


CONSTANT_REWARDS = """
def fails(text, label, stopped):
    raise ValueError("no answer found")


def zero(text, label, stopped):
    return 0.0
"""


def test_a_reward_function_that_fails_on_every_sample_stops_the_rollout_naming_it(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    """Not a run that drops every group for good, logging each: past --rm-max-errors-in-a-row
    failures in a row the rollout loop stops (/health 503, which ends `tandem up` with it), and
    the log holds the first drops of the reason, then counts."""
    (tmp_path / "constant.py").write_text(CONSTANT_REWARDS)
    path = f"{tmp_path / 'constant.py'}:fails"
    args = router_args(buffer, toy_model_dir, [engines().url], "--custom-rm-path", path)
    router = start_service(
        "router", [*args, "--rm-max-errors-in-a-row", "60", "--eval-interval", "0"]
    )
    answer = wait_until(
        lambda: (r := httpx.get(router.url + "/health")).status_code == 503 and r.json(),
        "the rollout to stop",
        60,
    )
    failed = re.match(
        r"rollout task failed: RewardError: reward function fails failed on (\d+) samples in a "
        r"row \(--rm-max-errors-in-a-row 60\), the last: reward function fails raised "
        r"ValueError: no answer found; fix the function \(--custom-rm-path; a wrong or "
        r"unparsable answer should score 0, not fail\)",
        answer["error"],
    )
    assert failed and int(failed[1]) >= 60, answer  # (groups in flight may add a few)
    ledger = buffer.ledger()
    assert ledger.balanced and ledger.put == 0 and ledger.dropped_groups["reward_error"] >= 10
    log = router.log()
    assert log.count("dropping group") == 10
    assert "later reward_error drops are logged as counts" in log


def test_the_status_says_why_no_group_is_put_while_every_one_is_dropped(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    (tmp_path / "constant.py").write_text(CONSTANT_REWARDS)
    path = f"{tmp_path / 'constant.py'}:zero"
    args = router_args(buffer, toy_model_dir, [engines().url], "--custom-rm-path", path)
    router = start_service("router", [*args, "--dynamic-sampling", "--rm-workers", "0"])
    record = wait_until(
        lambda: (r := buffer.statuses().get("router")) and "note" in r.detail and r,
        "a note in the router's status",
    )
    assert re.fullmatch(
        r"\d+ groups dropped since the last one put \(all_rewards_equal \d+; the last: "
        r"every reward is 0.0\): --dynamic-sampling drops a group whose samples all score the "
        r"same: check the reward function on a few responses, or run without --dynamic-sampling",
        str(record.detail["note"]),
    ), record.detail
    status = get_json(router.url + "/rollout/status")
    assert "(all_rewards_equal" in status["note"] and "every reward is 0.0" in status["note"]
    assert buffer.depth() == 0


def test_the_status_names_the_engines_version_when_the_trainer_is_ahead(
    buffer, toy_model_dir, start_service, engines
):
    buffer.set_version("trainer", 5)
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url]))
    expected = (
        "engines on weight version >= 4 (they serve 0); the broker brings them there: "
        "see its /state"
    )
    # (before the engine is admitted the loop waits for workers: not this wait)
    status = wait_until(
        lambda: (
            (s := get_json(router.url + "/rollout/status"))["state"] == "waiting_for_weights" and s
        ),
        "the router to wait for weights",
    )
    assert status["waiting_for"] == expected
    record = wait_until(
        lambda: (r := buffer.statuses().get("router")) and r.state == "waiting_for_weights" and r,
        "the record",
    )
    assert (record.state, record.waiting_for) == ("waiting_for_weights", expected)
    assert record.detail["trainer_version"] == 5 and record.detail["engines_version"] == 0
    assert record.since <= time.time() and buffer.depth() == 0
    buffer.set_version("engines", 4)
    wait_until(lambda: buffer.depth() >= 4, "groups once the engines are on version 4")


def test_a_router_whose_batch_size_contradicts_the_run_contract_exits_2_naming_the_flag(
    buffer, toy_model_dir
):
    buffer.agree_contract(RunContract(rollout_batch_size=64, max_staleness=1), "trainer")
    args = router_args(buffer, toy_model_dir, [f"http://127.0.0.1:{free_port()}"])
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "rollout_batch_size is 64" in line and "--rollout-batch-size" in line
    assert "set by the trainer" in line and "started with 4" in line


def test_a_rollout_task_that_dies_makes_health_503_and_the_status_failed(
    buffer, toy_model_dir, engines, monkeypatch
):
    from fastapi.testclient import TestClient

    from services.rollout_router.app import create_app
    from services.rollout_router.config import RouterConfig
    from services.rollout_router.rollout.loop import RolloutLoop

    async def broken(*_args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(RolloutLoop, "make_group", broken)
    config = RouterConfig()
    config.workers.engine_urls = [engines().url]
    config.run.model = str(toy_model_dir)
    config.rollout.eval_interval = 0
    config.run.redis_url, config.run.run_id = buffer.config.redis_url, buffer.config.run_id
    with TestClient(create_app(config)) as client:
        resp = wait_until(
            lambda: (r := client.get("/health")).status_code == 503 and r, "/health to fail"
        )
        assert resp.json() == {
            "status": "failed",
            "error": "rollout task failed: RuntimeError: boom",
        }
        status = client.get("/rollout/status").json()
        assert status["state"] == "failed" and "boom" in status["error"]
        record = wait_until(
            lambda: (r := buffer.statuses().get("router")) and r.state == "failed" and r, "record"
        )
        assert "RuntimeError: boom" in record.error


def test_a_router_in_a_run_that_has_trained_evaluates_from_the_trainers_version(
    buffer, toy_model_dir, start_service, engines
):
    """A resume's engines start on the model's weights while the run's trainer is at 5: the
    router evaluated them at once (published as the run's newest evaluation). It now starts
    at the trainer's version, once the engines hold it."""
    buffer.set_version("trainer", 5)
    start_service("router", router_args(buffer, toy_model_dir, [engines().url]))
    time.sleep(4)  # (a new run's router evaluates within a second of its start)
    assert not [r.step for _id, r in buffer.read_metrics() if "eval/failed" in r.values]
    buffer.set_version("engines", 5)  # as the broker writes it once the engines hold 5
    evals = wait_until(
        lambda: [r.step for _id, r in buffer.read_metrics() if "eval/failed" in r.values],
        "an evaluation at version 5",
    )
    assert evals == [5]
