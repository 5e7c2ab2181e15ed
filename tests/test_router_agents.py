"""Agent environments over HTTP: environment servers driven by the router, and agents that
call the router's OpenAI API (official `openai` client) and post rewards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from proto import SampleGroup
from services.sample_buffer import SampleBuffer

ROOT = Path(__file__).resolve().parents[1]
# User turns end with `>`, assistant turns with `<eos>`: a history re-renders as an exact prefix.
CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'user' %}>{% else %}<eos>{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(toy_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("agentchat") / "model"
    shutil.copytree(toy_model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out


def router_args(buffer: SampleBuffer, model: Path, urls: list[str], *extra: str) -> list[str]:
    return [
        "router", "--port", "0", "--engine-urls", *urls, "--model", str(model),
        "--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--eval-interval", "0",
        "--rollout-max-response-len", "3", "--max-groups", "1000", *extra,
    ]  # fmt: skip


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def read_all(buffer: SampleBuffer) -> list[SampleGroup]:
    out = []
    while batch := buffer.read_groups("test", 1000, block_ms=None):
        out += [g for _id, g in batch]
    return out


class ScriptedEnv(BaseHTTPRequestHandler):
    """Two turns: replies `9>` with reward 0.25, then ends with reward 0.5. Episodes whose id
    ends in `hang_suffix` never answer /step in time; `fail_step` answers 500."""

    hang_suffix = "never"
    fail_step = False
    hang_s = 5.0
    turns: ClassVar[dict[str, int]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            return self.answer(200, {"observation": None})
        if self.fail_step:
            return self.answer(500, {"error": "broken"})
        episode = body["episode_id"]
        if episode.endswith(self.hang_suffix):
            time.sleep(self.hang_s)
        turn = self.turns[episode] = self.turns.get(episode, 0) + 1
        if turn == 1:
            return self.answer(200, {"observation": "9>", "reward": 0.25, "done": False})
        self.answer(200, {"observation": "", "reward": 0.5, "done": True})

    def answer(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def env_server() -> Iterator[Callable[..., str]]:
    servers = []

    def _start(**attrs: Any) -> str:
        handler = type("Env", (ScriptedEnv,), {"turns": {}, **attrs})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield _start
    for server in servers:
        server.shutdown()


def test_episodes_keep_exact_tokens_and_mask_environment_tokens(
    buffer, toy_model_dir, start_service, engines, env_server
):
    args = router_args(buffer, toy_model_dir, [engines().url], "--env-url", env_server())
    start_service("router", args)
    wait_until(lambda: buffer.depth() >= 2, "a batch of episodes")
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


def test_a_hung_environment_fails_only_its_episodes_and_the_batch_goes_on(
    buffer, toy_model_dir, start_service, engines, env_server
):
    url = env_server(hang_suffix="-e1")
    args = router_args(buffer, toy_model_dir, [engines().url], "--env-url", url,
                       "--env-call-timeout-s", "0.5")  # fmt: skip
    start_service("router", args)
    wait_until(lambda: buffer.depth() >= 4, "two batches despite the hung episodes")
    groups = read_all(buffer)
    assert all(len(g.samples) == 2 for g in groups), "episode e1 of each group failed"
    assert buffer.drop_counts()["env_timeout"] >= 4


def test_an_episode_past_its_deadline_fails_even_when_each_call_is_in_time(
    buffer, toy_model_dir, start_service, engines, env_server
):
    url = env_server(hang_suffix="", hang_s=0.4)  # every step takes 0.4 s
    args = router_args(buffer, toy_model_dir, [engines().url], "--env-url", url,
                       "--env-call-timeout-s", "5", "--env-episode-timeout-s", "0.6")  # fmt: skip
    start_service("router", args)
    wait_until(lambda: buffer.drop_counts().get("env_timeout", 0) >= 6, "deadline drops")
    assert any("passed its deadline" in d.detail for d in buffer.drop_log(20))
    assert buffer.depth() == 0


def test_a_failing_environment_is_counted_per_episode_and_group(
    buffer, toy_model_dir, start_service, engines, env_server
):
    args = router_args(buffer, toy_model_dir, [engines().url], "--env-url",
                       env_server(fail_step=True))  # fmt: skip
    start_service("router", args)
    wait_until(lambda: buffer.drop_counts().get("env_all_failed", 0) >= 2, "failed groups")
    drops = buffer.drop_counts()
    assert drops["env_error"] >= 6 and buffer.depth() == 0


def test_the_example_guess_environment_runs_under_the_router(
    buffer, toy_model_dir, start_service, engines, tmp_path
):
    from services.sample_buffer.server import _free_port

    port = _free_port("127.0.0.1")
    env = subprocess.Popen([sys.executable, str(ROOT / "examples/guess_env.py"), "--port", str(port)],
                           stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert env.stdout is not None and "guess env on" in env.stdout.readline().decode()
        args = router_args(buffer, toy_model_dir, [engines().url],
                           "--env-url", f"http://127.0.0.1:{port}", "--env-max-turns", "4")  # fmt: skip
        start_service("router", args)
        wait_until(lambda: buffer.depth() >= 2, "episodes of the guessing game")
    finally:
        env.terminate()
        env.wait()
    samples = [s for g in read_all(buffer) for s in g.samples]
    assert all(s.reward in (0.0, 1.0) for s in samples)
    assert all(s.prompt_ids == [1, 14] for s in samples), "reset observation `>`"
    assert buffer.drop_counts() == {}


def test_an_openai_client_session_becomes_a_training_sample_with_exact_tokens(
    buffer, chat_model_dir, start_service, engines
):
    from openai import OpenAI

    router = start_service("router", router_args(buffer, chat_model_dir, [engines().url],
                                                 "--no-rollout"))  # fmt: skip
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
    second = client.chat.completions.create(model="toy", messages=messages, max_tokens=4,
                                            logprobs=True, extra_headers=session)  # fmt: skip
    assert second.choices[0].logprobs is not None
    assert [t.token for t in second.choices[0].logprobs.content] == ["<eos>"]
    assert first.choices[0].logprobs is None, "only when asked for"
    assert buffer.depth() == 0, "nothing is trained before the reward"
    put = httpx.post(router.url + "/sessions/s1/reward", json={"reward": 0.5}).json()
    assert put["status"] == "put"
    (group,) = read_all(buffer)
    (sample,) = group.samples
    assert sample.prompt_ids == [1, 5, 6, 14]
    assert sample.response_ids == [6, 5, 2, 7, 8, 14, 2]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0, 1]
    assert sample.reward == 0.5
    assert httpx.post(router.url + "/sessions/s1/reward", json={"reward": 1}).status_code == 404


def test_sessions_of_one_group_become_one_sample_group(
    buffer, chat_model_dir, start_service, engines
):
    from openai import OpenAI

    router = start_service("router", router_args(buffer, chat_model_dir, [engines().url],
                                                 "--no-rollout"))  # fmt: skip
    client = OpenAI(base_url=router.url + "/v1", api_key="unused")
    for k in range(3):
        client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "12"}],
                                       max_tokens=4, extra_body={"session_id": f"g{k}"})  # fmt: skip
        reply = httpx.post(f"{router.url}/sessions/g{k}/reward",
                           json={"reward": float(k), "group": "task-12", "group_size": 3}).json()  # fmt: skip
        assert reply["status"] == ("put" if k == 2 else "pending")
    (group,) = read_all(buffer)
    assert group.group_id == "group-task-12"
    assert [s.reward for s in group.samples] == [0.0, 1.0, 2.0]


def test_a_streamed_session_turn_is_recorded_and_arrives_as_openai_chunks(
    buffer, chat_model_dir, start_service, engines
):
    from openai import OpenAI

    router = start_service("router", router_args(buffer, chat_model_dir, [engines().url],
                                                 "--no-rollout"))  # fmt: skip
    client = OpenAI(base_url=router.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="toy", messages=[{"role": "user", "content": "12"}], max_tokens=4, stream=True,
        extra_headers={"X-Session-Id": "streamed"},
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "21"
    assert chunks[-1].choices[0].finish_reason == "stop"
    httpx.post(router.url + "/sessions/streamed/reward", json={"reward": 1.0})
    (group,) = read_all(buffer)
    assert group.samples[0].response_ids == [6, 5, 2]


def test_openai_requests_without_a_session_are_forwarded_to_an_engine(
    buffer, chat_model_dir, start_service, engines
):
    router = start_service("router", router_args(buffer, chat_model_dir, [engines().url],
                                                 "--no-rollout"))  # fmt: skip
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = httpx.post(router.url + path, json={"model": "m", "messages": [], "prompt": "x"})
        assert resp.status_code == 200
        assert resp.json()["object"] == path, "answered by the engine, not recorded"
    assert httpx.post(router.url + "/sessions/nobody/reward", json={"reward": 1}).status_code == 404


def test_the_example_chat_agent_trains_through_sessions(
    buffer, toy_model_dir, start_service, engines
):
    router = start_service("router", router_args(buffer, toy_model_dir, [engines().url],
                                                 "--no-rollout"))  # fmt: skip
    agent = subprocess.run(
        [sys.executable, str(ROOT / "examples/chat_agent.py"), "--router-url", router.url,
         "--groups", "3", "--group-size", "2", "--concurrency", "4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert agent.returncode == 0, agent.stderr
    assert "episodes: 6" in agent.stdout
    groups = read_all(buffer)
    assert len(groups) == 3 and all(len(g.samples) == 2 for g in groups)
    assert all(s.prompt_ids[0] == 1 and s.prompt_ids[-1] == 14 for g in groups for s in g.samples)
