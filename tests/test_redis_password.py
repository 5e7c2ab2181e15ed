"""A Redis that requires a password (requirepass): every client Tandem makes sends
TANDEM_REDIS_PASSWORD, and a missing or wrong one is said in one line naming that variable,
at once (not waited out as a Redis that is down), without printing any password.

Against a real Valkey server started here with --requirepass; the services and commands run as
real processes through the CLI.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.rollout_router.rollout.metrics import LoopObserver
from services.sample_buffer import AsyncSampleBuffer, BufferConfig, SampleBuffer
from services.sample_buffer.password import PASSWORD_ENV, RedisPasswordError
from services.sample_buffer.server import find_server_binary
from services.trainer.redis_wait import patient_client
from tandem.run_redis import client_of, no_answer
from tandem.supervisor import die_with_parent

PASSWORD = secrets.token_hex(16)
WRONG = secrets.token_hex(16)
RUN_ID = "pw"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def locked_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL (no password in it) of a Valkey that requires PASSWORD."""
    folder, port = tmp_path_factory.mktemp("locked-redis"), free_port()
    cmd = [find_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--dir", str(folder), "--requirepass", PASSWORD]
    server = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, password=PASSWORD, socket_connect_timeout=1)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None:
                    raise
                client.connection_pool.disconnect()
                time.sleep(0.1)
        client.ping()
        yield url
    finally:
        server.terminate()
        server.wait(10)


def use_password(monkeypatch: pytest.MonkeyPatch, password: str) -> None:
    if password:
        monkeypatch.setenv(PASSWORD_ENV, password)
    else:
        monkeypatch.delenv(PASSWORD_ENV, raising=False)


def test_every_client_tandem_makes_sends_the_password_from_the_environment(
    locked_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_password(monkeypatch, PASSWORD)
    buffer = SampleBuffer(BufferConfig(redis_url=locked_url, run_id=RUN_ID))
    buffer.wait_ready(5.0)
    buffer.set_version("trainer", 3)
    assert patient_client(locked_url, 5.0, 100).get(f"tandem:{RUN_ID}:version:trainer") == b"3"
    assert client_of(locked_url).ping() and no_answer(locked_url) == ""

    async def router_side() -> None:
        aio = AsyncSampleBuffer(BufferConfig(redis_url=locked_url, run_id=RUN_ID))
        await aio.wait_ready(5.0)
        observer = LoopObserver(aio)  # (its timeline writer has a client of its own)
        assert observer.timeline is not None and observer.timeline.redis.ping()
        observer.timeline.close()
        await aio.aclose()

    asyncio.run(router_side())


@pytest.mark.parametrize("password", ["", WRONG], ids=["missing", "wrong"])
def test_a_missing_or_wrong_password_is_refused_at_once_naming_the_variable(
    locked_url: str, monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    use_password(monkeypatch, password)
    config = BufferConfig(redis_url=locked_url, run_id=RUN_ID)
    with pytest.raises(RedisPasswordError) as sync_refusal:
        SampleBuffer(config).wait_ready(30.0)
    with pytest.raises(RedisPasswordError) as async_refusal:
        asyncio.run(AsyncSampleBuffer(config).wait_ready(30.0))
    # The trainer's client waits out a Redis that is down (RedisUnavailableError after its
    # timeout); a refused password is not that, and is raised as itself.
    with pytest.raises(RedisPasswordError) as trainer_refusal:
        patient_client(locked_url, 30.0, 100).ping()
    state = "is set to another password" if password else "is not set"
    for refusal in (sync_refusal, async_refusal, trainer_refusal):
        said = str(refusal.value)
        assert PASSWORD_ENV in said and state in said and locked_url in said, said
        assert PASSWORD not in said and WRONG not in said
    assert PASSWORD_ENV in no_answer(locked_url, wait_s=30.0)


def tandem(*args: str, password: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    env.update({PASSWORD_ENV: password} if password else {})
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.parametrize("password", ["", WRONG], ids=["missing", "wrong"])
def test_services_and_commands_say_a_refused_password_in_one_line_without_printing_it(
    locked_url: str, toy_model_dir: Path, tmp_path: Path, password: str
) -> None:
    run = ["--redis-url", locked_url, "--run-id", RUN_ID]
    trainer = ["trainer", "--model", str(toy_model_dir), "--save", str(tmp_path / "ckpt"), *run]
    for args, code in (
        (["broker", "--port", "0", *run], 2),
        (trainer, 2),
        (["metrics", *run], 2),
        (["ledger", *run], 2),
    ):
        done = tandem(*args, password=password)
        said = done.stdout + done.stderr
        assert done.returncode == code, (args[0], done.returncode, said[-3000:])
        assert PASSWORD_ENV in said and "Traceback" not in said, (args[0], said[-3000:])
        assert PASSWORD not in said and WRONG not in said, args[0]


def test_a_broker_with_the_password_joins_the_run_and_never_prints_it(
    locked_url: str, start_service, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_password(monkeypatch, PASSWORD)
    broker = start_service(
        "broker", ["broker", "--port", "0", "--redis-url", locked_url, "--run-id", RUN_ID]
    )
    held = redis.Redis.from_url(locked_url, password=PASSWORD).keys(f"tandem:{RUN_ID}:*")
    broker.stop()
    assert any(b"lease" in key for key in held), held
    assert PASSWORD not in broker.log()


def test_a_redis_without_a_password_takes_a_client_that_sends_one(
    redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variable left set (a stack's) does not lock Tandem out of a Redis that asks for no
    password, such as the private one `tandem up` starts."""
    use_password(monkeypatch, PASSWORD)
    buffer = SampleBuffer(BufferConfig(redis_url=redis_server.url, run_id=RUN_ID))
    buffer.wait_ready(5.0)
    assert buffer.redis.ping() and no_answer(redis_server.url) == ""
