"""Agent environments over HTTP: environment servers driven by the router, and agents that
call the router's OpenAI API (official `openai` client) and post rewards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import aiohttp
import httpx
import psutil
import pytest

from proto.contract import SampleLimits
from services.sample_buffer import SampleBuffer
from tests.helpers import JsonHandler, read_all, serving, wait_until, with_chat_template
from tests.helpers import router_args as shared_router_args

ROOT = Path(__file__).resolve().parents[1]
# User turns end with `>`, assistant turns with `<eos>`: a history re-renders as an exact prefix.
CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'user' %}>{% else %}<eos>{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("agentchat") / "model"
    return with_chat_template(toy_model_dir, out, CHAT_TEMPLATE)


def router_args(buffer: SampleBuffer, model: Path, urls: list[str], *extra: str) -> list[str]:
    return shared_router_args(
        buffer, model, urls, "--eval-interval", "0", *extra, batch=2, n=3, response_len=3
    )


class ScriptedEnv(JsonHandler):
    """Two turns: replies `9>` with reward 0.25, then ends with reward 0.5. Episodes whose id
    ends in `hang_suffix` never answer /step in time; `fail_step` answers 500."""

    hang_suffix = "never"
    fail_step = False
    hang_s = 5.0
    turns: ClassVar[dict[str, int]] = {}
    answers: ClassVar[dict[str, dict[str, Any]]] = {}  # episode id suffix: its /step answer
    resets: ClassVar[dict[str, dict[str, Any]]] = {}  # episode id suffix: its /reset answer

    def do_POST(self) -> None:  # noqa: N802 - http.server names it
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        episode = body["episode_id"]
        if self.path == "/reset":
            given = (a for suffix, a in self.resets.items() if episode.endswith(suffix))
            return self.send_json(200, next(given, {"observation": None}))
        if self.fail_step:
            return self.send_json(500, {"error": "broken"})
        for suffix, answer in self.answers.items():
            if episode.endswith(suffix):
                return self.send_json(200, answer)
        if episode.endswith(self.hang_suffix):
            time.sleep(self.hang_s)
        turn = self.turns[episode] = self.turns.get(episode, 0) + 1
        if turn == 1:
            return self.send_json(200, {"observation": "9>", "reward": 0.25, "done": False})
        self.send_json(200, {"observation": "", "reward": 0.5, "done": True})


@pytest.fixture
def env_server() -> Iterator[Callable[..., str]]:
    with ExitStack() as servers:

        def _start(**attrs: Any) -> str:
            handler = type("Env", (ScriptedEnv,), {"turns": {}, **attrs})
            return servers.enter_context(serving(handler))

        yield _start


def test_episodes_keep_exact_tokens_and_mask_environment_tokens(
    buffer, toy_model_dir, start_service, engines, env_server
):
    url = env_server()
    args = router_args(
        buffer, toy_model_dir, [engines().url], "--env-url", url, "--eval-interval", "1"
    )
    router = start_service("router", args)
    wait_until(lambda: buffer.depth() >= 2, "a batch of episodes")
    # Evaluation plays the environment too: one greedy episode per held-out task.
    assert router.info["eval_task"].startswith(f"environment {url}: one greedy episode")
    values = wait_until(
        lambda: next(
            (r.values for _i, r in buffer.read_metrics() if "eval/accuracy" in r.values), None
        ),
        "an evaluation",
    )
    assert values["eval/num_prompts"] == 20 and values["eval/reward_mean"] == pytest.approx(0.75)
    for group in read_all(buffer):
        assert len(group.samples) == 3
        for s in group.samples:
            assert s.reward == pytest.approx(0.75), "sum of the step rewards"
            env_at = [i for i, m in enumerate(s.loss_mask) if m == 0]
            assert [s.response_ids[i] for i in env_at] == [13, 14], "`9>` as masked env tokens"
            assert s.loss_mask == [1] * env_at[0] + [0, 0] + [1] * (
                len(s.loss_mask) - env_at[1] - 1
            )
            assert [s.response_logprobs[i] for i in env_at] == [0.0, 0.0]
            assert len(s.response_ids) == len(s.response_logprobs) == len(s.token_versions)
            assert s.prompt_ids[0] == 1 and s.prompt_ids[-1] == 14


@pytest.mark.parametrize(
    ("limits", "most", "most_response"),
    [
        (None, 64, 64),  # no trainer has stated its limits: the model's context bounds it
        (SampleLimits(max_tokens=40, max_response_len=1000), 40, 40),
        (SampleLimits(max_tokens=64, max_response_len=25), 64, 25),
    ],
    ids=["context", "trainer-tokens", "trainer-response"],
)
def test_an_episode_that_fills_the_context_ends_on_the_models_tokens(
    buffer, toy_model_dir, start_service, engines, env_server, limits, most, most_response
):
    """Each step answers 20 tokens of observation and the episode never ends: once the context
    (64 positions), or what the trainer takes, leaves no room for a model turn the episode
    stops there, its last observation cut, with no engine error (the trainer trains it; it
    dead-lettered longer ones as too_long)."""

    def endless(self: ScriptedEnv) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            return self.send_json(200, {"observation": None})
        assert body["episode_id"]
        self.send_json(200, {"observation": "9" * 19 + ">", "reward": 0.25, "done": False})

    url = env_server(do_POST=endless)
    if limits is not None:
        buffer.set_limits(limits)  # as the run's trainer does at its start
    extra = ("--env-url", url, "--env-max-turns", "50")
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url], *extra))
    wait_until(lambda: buffer.depth() >= 2, "a batch of episodes")
    for group in read_all(buffer):
        for s in group.samples:
            assert len(s.prompt_ids) + len(s.response_ids) <= most
            assert len(s.response_ids) <= most_response
            bound = min(most, len(s.prompt_ids) + most_response)
            assert len(s.prompt_ids) + len(s.response_ids) >= bound - 20, "cut at the bound"
            assert s.finish_reason == "length"
            assert s.loss_mask[-1] == 1, "the last tokens are the model's"
            assert s.loss_mask.count(0) % 20 == 0, "whole observations, the last one cut"
            assert s.reward == pytest.approx(0.25 * (s.loss_mask.count(0) // 20 + 1))
    status = httpx.get(router.url + "/rollout/status").json()
    assert status["drops"] == {} and status["state"] != "backing_off", status


def test_a_huge_observation_ends_its_episode_untokenized_and_it_is_trained(
    buffer, toy_model_dir, start_service, engines, env_server
):
    """20 million characters cannot fit in 64 positions: the episode ends after the model's turn
    (finish length), trained. It was tokenized first, holding the router's event loop for half
    a minute (each episode here then passed its 5 s deadline: env_timeout)."""

    def huge(self: ScriptedEnv) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/reset":
            return self.send_json(200, {"observation": None})
        self.send_json(200, {"observation": "9" * 20_000_000, "reward": 0.25, "done": False})

    extra = ("--env-url", env_server(do_POST=huge), "--env-episode-timeout-s", "5")
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url], *extra))
    wait_until(lambda: buffer.depth() >= 2, "a batch of episodes")
    for s in [s for g in read_all(buffer) for s in g.samples]:
        assert s.finish_reason == "length" and s.reward == 0.25
        assert s.loss_mask == [1] * len(s.response_ids), "the observation left out"
    status = httpx.get(router.url + "/rollout/status").json()
    assert status["drops"] == {}, status


def test_a_first_observation_that_fills_the_context_drops_its_episodes_with_the_fix(
    buffer, toy_model_dir, start_service, engines, env_server
):
    def long_reset(self: ScriptedEnv) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_json(200, {"observation": "1" * 69 + ">", "reward": 0.0, "done": False})

    url = env_server(do_POST=long_reset)
    router = start_service(
        "router", router_args(buffer, toy_model_dir, [engines().url], "--env-url", url)
    )
    wait_until(lambda: buffer.drop_counts().get("prompt_too_long", 0) >= 2, "groups dropped")
    episode = next(r for r in buffer.drop_log(1000) if r.count == 0)
    assert episode.reason == "prompt_too_long" and episode.samples == 1
    assert episode.detail.startswith("the first observation: ") and episode.detail.endswith(
        "tokens fill the model's context of 64 positions (max_position_embeddings); shorten "
        "the environment's first observation, or raise that bound"
    )
    status = httpx.get(router.url + "/rollout/status").json()
    assert set(status["drops"]) == {"prompt_too_long"} and status["state"] != "backing_off"


def test_an_episode_cut_by_max_turns_ends_on_the_models_tokens(
    buffer, toy_model_dir, start_service, engines, env_server
):
    """One turn allowed, the environment not done: its reply `9>` would precede no model turn,
    so it is not part of the trajectory."""
    args = router_args(
        buffer, toy_model_dir, [engines().url], "--env-url", env_server(), "--env-max-turns", "1"
    )
    start_service("router", args)
    wait_until(lambda: buffer.depth() >= 2, "a batch of one-turn episodes")
    samples = [s for g in read_all(buffer) for s in g.samples]
    assert samples
    for s in samples:
        assert s.reward == pytest.approx(0.25), "the one step's reward"
        assert s.loss_mask == [1] * len(s.response_ids), "no environment tokens"
        assert s.finish_reason == "length"


def test_a_hung_environment_fails_only_its_episodes_and_the_batch_goes_on(
    buffer, toy_model_dir, start_service, engines, env_server
):
    url = env_server(hang_suffix="-e1")
    args = router_args(
        buffer, toy_model_dir, [engines().url], "--env-url", url, "--env-call-timeout-s", "0.5"
    )
    start_service("router", args)
    wait_until(lambda: buffer.depth() >= 4, "two batches despite the hung episodes")
    groups = read_all(buffer)
    assert all(len(g.samples) == 2 for g in groups), "episode e1 of each group failed"
    assert buffer.drop_counts("samples")["env_timeout"] >= 4


def test_an_episode_past_its_deadline_fails_even_when_each_call_is_in_time(
    buffer, toy_model_dir, start_service, engines, env_server
):
    url = env_server(hang_suffix="", hang_s=0.4)  # every step takes 0.4 s
    args = router_args(
        buffer,
        toy_model_dir,
        [engines().url],
        "--env-url",
        url,
        "--env-call-timeout-s",
        "5",
        "--env-episode-timeout-s",
        "0.6",
    )
    start_service("router", args)
    wait_until(lambda: buffer.drop_counts("samples").get("env_timeout", 0) >= 6, "deadline drops")
    assert any("passed its deadline" in d.detail for d in buffer.drop_log(20))
    assert buffer.depth() == 0


def test_a_failing_environment_is_counted_per_episode_and_group(
    buffer, toy_model_dir, start_service, engines, env_server
):
    args = router_args(
        buffer, toy_model_dir, [engines().url], "--env-url", env_server(fail_step=True)
    )
    start_service("router", args)
    wait_until(lambda: buffer.drop_counts().get("env_all_failed", 0) >= 2, "failed groups")
    drops = buffer.drop_counts("samples")
    assert drops["env_error"] >= 6 and buffer.depth() == 0
    said = [d.detail for d in buffer.drop_log(10) if d.reason == "env_error"]
    assert said and all(d.endswith('/step: HTTP 500 {"error": "broken"}') for d in said), said


def test_a_step_answer_with_text_for_reward_or_done_fails_its_episode_naming_it(
    buffer, toy_model_dir, start_service, engines, env_server
):
    """`"reward": "1"` was taken for 1 and `"done": "false"` ended every episode (truthy); a
    reward past a float's range ended the rollout loop (OverflowError). A /reset observation
    that is an object was said to fail the chat template."""
    image = [{"role": "user", "content": [{"type": "image_url"}]}]  # (was its Python text)
    answers = {"-e0": {"reward": "1", "done": True}, "-e1": {"reward": 1, "done": "false"}}
    answers["p1-e2"] = {"observation": image, "reward": 0, "done": False}  # (one group)
    answers["p2-e2"] = {"reward": 10**400, "done": True}  # (it raised out of the rollout loop)
    url = env_server(answers=answers, resets={"p3-e2": {"observation": {"text": "12"}}})
    start_service("router", router_args(buffer, toy_model_dir, [engines().url], "--env-url", url))
    # (each group whose episodes all fail backs the rollout off, 1 s, 2 s, 4 s, ...: on a loaded
    # machine p1-p3 failed before p4 started, which then waited past 30 s)
    wait_until(lambda: buffer.depth() >= 2, "groups of the episodes that answered well", 120)
    assert all(len(g.samples) == 1 and g.samples[0].reward == 0.75 for g in read_all(buffer))
    details = [d.detail for d in buffer.drop_log(50) if d.reason == "env_error"]
    assert any("/step reward: expected a number, got '1'" in d for d in details), details
    assert any("/step done: expected true or false, got 'false'" in d for d in details), details
    assert any("/step observation: messages[0].content[0]: a part must be" in d for d in details)
    assert any(
        "/step reward: 10000000000000000000... is beyond a float's range" in d for d in details
    )
    assert "/reset observation: expected a string, chat messages or null, got dict" in details


def test_the_example_guess_environment_runs_under_the_router(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    from services.sample_buffer.server import _free_port

    port = _free_port("127.0.0.1")
    env = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/guess_env.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
    )
    try:
        assert env.stdout is not None and "guess env on" in env.stdout.readline().decode()
        args = router_args(
            buffer,
            toy_model_dir,
            [engines().url],
            "--env-url",
            f"http://127.0.0.1:{port}",
            "--env-max-turns",
            "4",
        )
        start_service("router", args)
        wait_until(lambda: buffer.depth() >= 2, "episodes of the guessing game")
        drops = buffer.drop_counts("samples")  # before the environment stops under the router
    finally:
        env.terminate()
        env.wait()
    samples = [s for g in read_all(buffer) for s in g.samples]
    assert all(s.reward in (0.0, 1.0) for s in samples)
    assert all(s.prompt_ids == [1, 14] for s in samples), "reset observation `>`"
    assert drops == {}


def test_an_openai_client_session_becomes_a_training_sample_with_exact_tokens(
    buffer, chat_model_dir, start_service, engines
):
    from openai import OpenAI

    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    )
    client = OpenAI(base_url=router.url + "/v1", api_key="unused")
    session = {"X-Session-Id": "s1"}
    messages = [{"role": "user", "content": "12"}]
    first = client.chat.completions.create(
        model="toy", messages=messages, max_tokens=4, extra_headers=session
    )
    assert first.choices[0].message.content == "21"
    assert first.choices[0].finish_reason == "stop"
    assert first.usage is not None and first.usage.prompt_tokens == 4
    messages += [{"role": "assistant", "content": "21"}, {"role": "user", "content": "34"}]
    second = client.chat.completions.create(
        model="toy",
        messages=messages,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_headers=session,
    )
    assert second.choices[0].logprobs is not None
    (eos,) = second.choices[0].logprobs.content
    assert eos.token == "<eos>"
    # (top_logprobs were [] whatever was asked): the sampled token leads greedy's choice here
    assert len(eos.top_logprobs) == 2 and eos.top_logprobs[0].token == "<eos>"
    assert eos.top_logprobs[0].logprob == pytest.approx(eos.logprob)
    assert eos.top_logprobs[1].logprob <= eos.logprob
    assert first.choices[0].logprobs is None, "only when asked for"
    assert buffer.depth() == 0, "nothing is trained before the reward"
    for bad, words in [  # each refused before the session is touched: it stays open
        ('{"reward": 1e400}', "finite number"),
        ('{"reward": 1, "group": "g", "group_size": 0}', "greater than or equal to 1"),
        ('{"reward": 1, "group": ""}', "at least 1 character"),
        ('{"group_size": 1e400}', '"input":{"group_size":null}'),  # was a 500
        # (each was taken: the size ignored, or the group held until --session-ttl-s)
        ('{"reward": 1, "group_size": 3}', "group_size 3 needs a group"),
        ('{"reward": 1, "group": "g", "group_size": 1' + "0" * 30 + "}", "--max-sessions (10000)"),
    ]:
        resp = httpx.post(
            router.url + "/sessions/s1/reward",
            content=bad,
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 422 and words in resp.text, (bad, resp.text)
    put = httpx.post(router.url + "/sessions/s1/reward", json={"reward": 0.5}).json()
    assert put["status"] == "put"
    (group,) = read_all(buffer)
    (sample,) = group.samples
    assert sample.prompt_ids == [1, 5, 6, 14]
    assert sample.response_ids == [6, 5, 2, 7, 8, 14, 2]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0, 1]
    assert sample.reward == 0.5
    again = httpx.post(router.url + "/sessions/s1/reward", json={"reward": 1})  # a retry
    # (it was 404 "unknown or expired": the agent could take its reward for lost)
    assert again.status_code == 409, again.text
    assert "its reward was taken (reward 0.5, session-s1); a reward is taken once" in again.text


def test_sessions_of_one_group_become_one_sample_group(
    buffer, chat_model_dir, start_service, engines
):
    from openai import OpenAI

    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    )
    client = OpenAI(base_url=router.url + "/v1", api_key="unused")
    for k in range(3):  # (an id with a slash opened a session whose reward could not be posted)
        client.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "12"}],
            max_tokens=4,
            extra_body={"session_id": f"task-12/g{k}"},
        )
        reply = httpx.post(
            f"{router.url}/sessions/{quote(f'task-12/g{k}', safe='')}/reward",
            json={"reward": float(k), "group": "task-12", "group_size": 3},
        ).json()
        assert reply["status"] == ("put" if k == 2 else "pending")
    (group,) = read_all(buffer)
    assert group.group_id == "group-task-12"
    assert [s.reward for s in group.samples] == [0.0, 1.0, 2.0]


SOAK_SESSIONS, SOAK_IN_FLIGHT, SOAK_GROUP = 1_000, 100, 4


async def session_soak(url: str, pid: int, rss: list[float]) -> tuple[list[int], Counter]:
    """SOAK_SESSIONS agent sessions of two turns each, SOAK_IN_FLIGHT at a time, their
    rewards in groups of SOAK_GROUP; the statuses of the turns and the rewards' answers. The
    router's RSS after every SOAK_IN_FLIGHT sessions goes into `rss`."""
    statuses: list[int] = []
    answers: Counter[str] = Counter()
    limit = asyncio.Semaphore(SOAK_IN_FLIGHT)
    connector = aiohttp.TCPConnector(limit=SOAK_IN_FLIGHT)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def chat(sid: str, messages: list[dict[str, str]]) -> str:
            body = {"model": "toy", "messages": messages, "max_tokens": 4}
            headers = {"X-Session-Id": sid}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                statuses.append(r.status)
                return (await r.json())["choices"][0]["message"]["content"]

        async def one(k: int) -> None:
            sid = f"soak{k}"
            async with limit:
                messages = [{"role": "user", "content": "12"}]
                reply = await chat(sid, messages)
                messages += [{"role": "assistant", "content": reply}]
                await chat(sid, [*messages, {"role": "user", "content": "34"}])
                body = {"reward": 1.0, "group": f"t{k // SOAK_GROUP}", "group_size": SOAK_GROUP}
                async with http.post(f"{url}/sessions/{sid}/reward", json=body) as r:
                    statuses.append(r.status)
                    answers[(await r.json())["status"]] += 1
            done = sum(answers.values())
            if done % SOAK_IN_FLIGHT == 0:
                rss.append(psutil.Process(pid).memory_info().rss / 2**20)

        await asyncio.gather(*(one(k) for k in range(SOAK_SESSIONS)))
    return statuses, answers


def test_a_thousand_agent_sessions_through_the_router_lose_nothing_and_keep_memory_flat(
    buffer, chat_model_dir, start_service, engines
):
    """A bounded soak of the agent path: every turn answered, every session's sample put in its
    group (none left open), the ledger balanced, and the router's memory flat once warm."""
    urls = [engines().url, engines().url]
    extra = ("--no-rollout", "--max-buffer-depth", "0")
    router = start_service("router", router_args(buffer, chat_model_dir, urls, *extra))
    rss: list[float] = []
    statuses, answers = asyncio.run(session_soak(router.url, router.proc.pid, rss))
    print("router RSS (MiB) after each 100 sessions:", " ".join(f"{m:.0f}" for m in rss))
    groups = read_all(buffer)
    print(f"turns and rewards {len(statuses)}, answers {dict(answers)}, groups {len(groups)}")
    assert statuses == [200] * len(statuses) and len(statuses) == 3 * SOAK_SESSIONS
    groups_put = SOAK_SESSIONS // SOAK_GROUP
    assert answers == {"put": groups_put, "pending": SOAK_SESSIONS - groups_put}
    assert len(groups) == groups_put
    assert sum(len(g.samples) for g in groups) == SOAK_SESSIONS, "one merged sample a session"
    ledger = buffer.ledger()
    assert ledger.balanced and ledger.put == groups_put and ledger.in_flight == 0, ledger
    status = httpx.get(router.url + "/rollout/status").json()
    assert (status["sessions_open"], status["session_groups_pending"]) == (0, 0)
    warm, end = rss[2], rss[-1]
    assert end - warm < 40, f"router RSS grew {end - warm:.0f} MiB after warm-up: {rss}"


def test_a_streamed_session_turn_is_recorded_and_arrives_as_openai_chunks(
    buffer, chat_model_dir, start_service, engines
):
    from openai import OpenAI

    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    )
    client = OpenAI(base_url=router.url + "/v1", api_key="unused")
    chunks = list(
        client.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "12"}],
            max_tokens=4,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "streamed"},
        )
    )
    *turn, usage = chunks  # (the log-probs and the usage chunk were left out)
    assert "".join(c.choices[0].delta.content or "" for c in turn) == "21"
    assert turn[-1].choices[0].finish_reason == "stop"
    logprobs = [
        e.logprob for c in turn if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 3
    httpx.post(router.url + "/sessions/streamed/reward", json={"reward": 1.0})
    (group,) = read_all(buffer)
    assert group.samples[0].response_ids == [6, 5, 2]
    assert logprobs == pytest.approx(group.samples[0].response_logprobs), "the recorded ones"


def test_openai_requests_without_a_session_are_forwarded_to_an_engine(
    buffer, chat_model_dir, start_service, engines
):
    router = start_service(
        "router", router_args(buffer, chat_model_dir, [engines().url], "--no-rollout")
    )
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = httpx.post(router.url + path, json={"model": "m", "messages": [], "prompt": "x"})
        assert resp.status_code == 200
        assert resp.json()["object"] == path, "answered by the engine, not recorded"
    assert httpx.post(router.url + "/sessions/nobody/reward", json={"reward": 1}).status_code == 404


def test_the_example_chat_agent_trains_through_sessions(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    args = router_args(buffer, toy_model_dir, [engines().url], "--no-rollout")
    router = start_service("router", [*args, "--api-token", "s3cret"])
    (tmp_path / "api_token").write_text("s3cret\n")  # as tandem up keeps it in RUN_DIR
    command = [sys.executable, str(ROOT / "examples/chat_agent.py"), "--router-url", router.url]
    command += ["--groups", "3", "--group-size", "2", "--concurrency", "4"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    assert "wants its API token: pass --api-token-file RUN_DIR/api_token" in refused.stderr
    command += ["--api-token-file", str(tmp_path / "api_token")]
    agent = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0, agent.stderr
    assert "episodes: 6" in agent.stdout
    groups = read_all(buffer)
    assert len(groups) == 3 and all(len(g.samples) == 2 for g in groups)
    assert all(s.prompt_ids[0] == 1 and s.prompt_ids[-1] == 14 for g in groups for s in g.samples)
