"""Agent sessions: turns held to what the run's trainer takes in a sample (its stated limits,
`tandem:{run}:limits`): a turn ends with finish `length` where its sample would stop fitting,
and a turn whose sample already fills a limit is answered 400 naming the trainer's flag; and
what a stopping router, or a Redis down at a reward, does with open sessions. A real router in
front of a reference engine serving the toy model (it reverses digits)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from proto.contract import SampleLimits
from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from tandem.supervisor import die_with_parent
from tests.helpers import free_port, read_all, wait_until, with_chat_template
from tests.test_router_agents import CHAT_TEMPLATE, router_args


@pytest.fixture(scope="module")
def chat_model_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(
        toy_model_dir, tmp_path_factory.mktemp("limits") / "model", CHAT_TEMPLATE
    )


def chat(
    router: str, session: str, messages: list[dict[str, str]], **body: object
) -> httpx.Response:
    headers = {"X-Session-Id": session}
    return httpx.post(
        router + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 20, **body},
        headers=headers,
    )


def test_session_turns_are_clipped_to_what_the_trainer_takes_and_a_full_prompt_refused(
    buffer, chat_model_dir, start_service, engines
):
    buffer.set_limits(SampleLimits(max_tokens=8, max_response_len=100))  # as the trainer does
    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    )
    url, session = router.url + "/v1/chat/completions", {"X-Session-Id": "s1"}
    messages = [{"role": "user", "content": "1234"}]  # 6 tokens with the template's
    for max_tokens in (None, 50):  # the default, and more than the trainer takes
        body = {"messages": messages, **({"max_tokens": max_tokens} if max_tokens else {})}
        turn = httpx.post(url, json=body, headers=session).json()
        assert turn["usage"]["prompt_tokens"] + turn["usage"]["completion_tokens"] == 8
        assert turn["choices"][0]["finish_reason"] == "length", (turn["usage"], turn["choices"])
    messages = [{"role": "user", "content": "1234567890"}]
    full = httpx.post(url, json={"messages": messages}, headers=session)
    assert full.status_code == 400
    assert "the prompt (12 tokens) fills the 8 tokens the run's trainer takes in a sample" in (
        full.text
    ), full.text
    assert "--max-tokens-per-gpu" in full.text
    assert httpx.post(router.url + "/sessions/s1/reward", json={"reward": 1}).status_code == 200
    (group,) = read_all(buffer)
    assert all(len(s.prompt_ids) + len(s.response_ids) <= 8 for s in group.samples)


def test_a_session_sample_is_held_to_the_trainers_response_length(
    buffer, chat_model_dir, start_service, engines
):
    """A reference engine answers a two-digit prompt reversed, others `4 5 <eos>`. Before,
    only the sample's whole length was bounded: a merged sample whose response
    (its turns and the messages between them) outgrew --max-response-len was dead-lettered
    as too_long at the trainer, never trained."""
    buffer.set_limits(SampleLimits(max_tokens=100, max_response_len=2))
    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    ).url
    messages = [{"role": "user", "content": "12"}]  # prompt [<bos> 1 2 >]
    first = chat(router, "s1", messages).json()  # `2 1 <eos>`, cut where the bound ends
    assert first["usage"]["completion_tokens"] == 2, first
    assert first["choices"][0]["message"]["content"] == "21"
    assert first["choices"][0]["finish_reason"] == "length"
    messages += [{"role": "assistant", "content": "21"}, {"role": "user", "content": "3"}]
    full = chat(router, "s1", messages)  # merges: 2 response + `<eos> 3 >` between
    assert full.status_code == 400, full.text
    assert "already holds 5 response tokens" in full.text, full.text
    assert "--max-response-len 2" in full.text
    fresh = chat(router, "s1", [{"role": "user", "content": "5"}])  # a sample of its own
    assert fresh.status_code == 200, fresh.text
    assert httpx.post(f"{router}/sessions/s1/reward", json={"reward": 1}).is_success
    (group,) = read_all(buffer)
    assert sorted(len(s.response_ids) for s in group.samples) == [2, 2], group.samples


def test_a_turns_stop_token_ids_end_it_as_sglang_ends_it(
    buffer, chat_model_dir, start_service, engines
):
    """`stop_token_ids` (SGLang's chat field) end the turn beside the model's own stop tokens;
    they were dropped without a word, the turn generated past them. `no_stop_trim` and
    `skip_special_tokens` are booleans (test_router_session_tools: what they do)."""
    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    ).url
    stopped = chat(router, "s1", [{"role": "user", "content": "12"}], stop_token_ids=[6])
    assert stopped.json()["choices"][0]["finish_reason"] == "stop", stopped.text
    assert stopped.json()["usage"]["completion_tokens"] == 1, "`2` and no `1<eos>` after it"
    refused = chat(router, "s2", [{"role": "user", "content": "12"}], stop_token_ids=["2"])
    assert refused.status_code == 400 and "stop_token_ids must be a list" in refused.text
    twelve = [{"role": "user", "content": "12"}]
    for name in ("no_stop_trim", "skip_special_tokens"):
        refused = chat(router, "s4", twelve, **{name: "false"})
        assert refused.status_code == 400, refused.text
        assert f"{name} must be true or false, got 'false'" in refused.text


def test_a_model_without_a_chat_template_takes_the_messages_sglang_takes(
    buffer, toy_model_dir, start_service, engines
):
    """Without a chat template the contents are joined: a list of parts was joined as its
    Python text (an image part, an unknown role let through, a null content read `None`)."""
    router = start_service(
        "router", router_args(buffer, toy_model_dir, [engines().url], "--no-rollout")
    ).url
    plain = chat(router, "s1", [{"role": "user", "content": "12"}]).json()
    parts = [{"role": "user", "content": [{"type": "text", "text": "12"}]}]
    assert (
        chat(router, "s2", parts).json()["usage"]["prompt_tokens"]
        == plain["usage"]["prompt_tokens"]
    )
    cut = [{"role": "user", "content": "1"}, {"role": "assistant", "content": None}]
    joined = chat(router, "s3", [*cut, {"role": "user", "content": "2"}]).json()
    assert joined["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    for messages, words in [
        ([{"role": "wizard", "content": "12"}], "messages[0].role must be one of"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "Tandem trains on text only",
        ),
    ]:
        refused = chat(router, "s4", messages)
        assert refused.status_code == 400 and words in refused.text, refused.text


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_sessions_open_when_the_router_stops_are_recorded_as_dropped(
    buffer, chat_model_dir, start_service, engines, stop
):
    """An open session, and a group waiting for its second session's reward, when the router
    stops: each a `cancelled` drop, so the ledger balances (they vanished without a word). A
    router killed (SIGKILL, OOM) leaves them noted in Redis, and the next one records them
    (they were lost, recorded nowhere); a session put is not among them."""
    args = router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    router = start_service("router", args)
    for session in ("open", "g1", "put"):
        assert chat(router.url, session, [{"role": "user", "content": "12"}]).status_code == 200
    assert httpx.post(router.url + "/sessions/put/reward", json={"reward": 1}).status_code == 200
    pending = {"reward": 1, "group": "G", "group_size": 2}
    reply = httpx.post(router.url + "/sessions/g1/reward", json=pending).json()
    assert reply["status"] == "pending"
    assert buffer.ledger().generated == 1  # (a session is counted once put, or dropped)
    if stop == "sigterm":
        router.stop()
    else:
        os.killpg(router.proc.pid, signal.SIGKILL)
        router.proc.wait()
        assert buffer.drop_counts() == {}
        buffer.release_lease_of("router", router.proc.pid)  # (as tandem up does)
        start_service("router", args).stop()
    assert buffer.drop_counts() == {"cancelled": 2}
    assert buffer.drop_counts("samples") == {"cancelled": 1}  # the pending group's sample
    ledger = buffer.ledger()
    assert (ledger.generated, ledger.dropped) == (3, 2) and ledger.balanced, ledger
    assert buffer.redis.hlen(buffer.open_sessions_key) == 0


def test_a_turn_generating_as_its_reward_closes_the_session_opens_one_a_killed_router_records(
    buffer, chat_model_dir, start_service, engines
):
    """The agent posts its reward while a turn of the session still generates: that turn opens
    a new session (as a turn after a reward does), listed open in Redis, so that the router
    after a killed one records it dropped; it was listed nowhere, lost without a record."""
    args = router_args(buffer, chat_model_dir, [engines("--delay-ms", "1000").url], "--no-rollout")
    router = start_service("router", args)
    messages = [{"role": "user", "content": "12"}]
    assert chat(router.url, "s", messages).status_code == 200
    with ThreadPoolExecutor(1) as agent:
        late = agent.submit(chat, router.url, "s", messages)
        wait_until(
            lambda: httpx.get(router.url + "/workers").json()["workers"][0]["outstanding"],
            "the late turn at the engine",
        )
        reward = httpx.post(router.url + "/sessions/s/reward", json={"reward": 1}).json()
        assert reward["status"] == "put" and late.result().status_code == 200
    assert buffer.redis.hexists(buffer.open_sessions_key, "s"), "the late turn's session"
    os.killpg(router.proc.pid, signal.SIGKILL)
    router.proc.wait()
    buffer.release_lease_of("router", router.proc.pid)  # (as tandem up does)
    start_service("router", args).stop()
    assert buffer.drop_counts() == {"cancelled": 1}
    ledger = buffer.ledger()
    assert (ledger.generated, ledger.put, ledger.dropped) == (2, 1, 1) and ledger.balanced, ledger


def test_a_reward_redis_refuses_leaves_its_session_open_for_the_retry(
    tmp_path, chat_model_dir, start_service, engines
):
    """Redis down as a reward is posted: the session (and the group it completes) stays open,
    answered 503 to post again; once Redis is back the retry puts it. Before, the post was
    answered 500, and the session and its group's samples were gone, recorded nowhere."""
    data = {"data_dir": tmp_path / "redis", "preexec_fn": die_with_parent}
    redis = RedisServer(port=free_port(), **data).start()
    try:
        buffer = SampleBuffer(BufferConfig(redis_url=redis.url, run_id="redis-down"))
        router = start_service(
            "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
        ).url
        for session in ("lone", "g1", "g2"):
            assert chat(router, session, [{"role": "user", "content": "12"}]).status_code == 200
        in_group = {"reward": 1, "group": "G", "group_size": 2}
        reply = httpx.post(router + "/sessions/g1/reward", json=in_group).json()
        assert reply["status"] == "pending"
        redis.stop()
        try:
            for session, body in (("g2", in_group), ("lone", {"reward": 0.5})):
                refused = httpx.post(f"{router}/sessions/{session}/reward", json=body, timeout=30)
                assert refused.status_code == 503, refused.text
                assert "Redis is unavailable" in refused.text
                assert "the session stays open" in refused.text and refused.headers["Retry-After"]
            # a new session's first turn: noted in Redis before it is generated (a 500 before)
            body = {"messages": [{"role": "user", "content": "12"}], "max_tokens": 20}
            turn = httpx.post(
                router + "/v1/chat/completions", json=body, headers={"X-Session-Id": "new"}
            )
            assert turn.status_code == 503 and "nothing was generated" in turn.text, turn.text
        finally:
            redis = RedisServer(port=redis.port, **data).start()
        for session, body in (("g2", in_group), ("lone", {"reward": 0.5})):
            put = httpx.post(f"{router}/sessions/{session}/reward", json=body, timeout=30)
            assert put.status_code == 200 and put.json()["status"] == "put", put.text
        groups = {g.group_id: g for g in read_all(buffer)}
        assert sorted(groups) == ["group-G", "session-lone"]
        assert len(groups["group-G"].samples) == 2 and len(groups["session-lone"].samples) == 1
        assert buffer.ledger().balanced, buffer.ledger()
    finally:
        redis.stop()
