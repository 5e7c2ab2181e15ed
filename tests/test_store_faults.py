"""The run knows its store: real Valkey/Redis server processes (each test its own, on loopback)
and the services' real code as processes. A Redis that evicts keys at its memory limit is
refused at start naming the setting; one restarted empty mid-run (no persistence) stops the run,
naming what was lost and what `--resume` does, instead of every service writing its keys again
and the run ending `max_steps` with groups trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from services.sample_buffer import BufferConfig, RedisServer, SampleBuffer
from services.sample_buffer.membership import Membership
from tests.helpers import wait_until

BROKER = [sys.executable, "-m", "services.weight_broker"]


@pytest.fixture
def redis_alone(tmp_path: Path):
    """A Redis server of this test's own (no persistence, as an external one may run)."""
    with RedisServer(log_dir=tmp_path / "redis") as server:
        yield server


def restart_empty(server: RedisServer) -> RedisServer:
    """The same server restarted on its port without the data it held."""
    port, log_dir = server.port, server.log_dir
    server.stop()
    return RedisServer(port=port, log_dir=log_dir).start()


def test_a_redis_that_evicts_keys_is_refused_at_start_naming_the_setting(
    redis_alone: RedisServer,
) -> None:
    client = SampleBuffer(BufferConfig(redis_alone.url, "evicting")).redis
    client.config_set("maxmemory", str(64 << 20))
    client.config_set("maxmemory-policy", "allkeys-lru")
    args = ["--port", "0", "--redis-url", redis_alone.url, "--run-id", "evicting"]
    done = subprocess.run([*BROKER, *args], capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "maxmemory-policy allkeys-lru" in said and "noeviction" in said
    # The setting fixed, the same start is taken.
    client.config_set("maxmemory-policy", "noeviction")
    member = Membership(SampleBuffer(BufferConfig(redis_alone.url, "evicting")), "broker", print)
    member.join(lambda _holder: None)
    assert member.held
    member.release()


def test_a_redis_without_persistence_is_said_at_start_not_refused(
    redis_alone: RedisServer,
) -> None:
    said: list[str] = []
    member = Membership(
        SampleBuffer(BufferConfig(redis_alone.url, "memory")), "router", said.append
    )
    member.join(lambda _holder: None)
    assert member.held
    assert any("appendonly no" in s and "appendonly yes keeps it" in s for s in said), said
    member.release()


TRAINER_MEMBER = textwrap.dedent(
    """
    import sys, time
    from services.sample_buffer import BufferConfig, SampleBuffer
    from services.trainer.lease import end_on_lost, trainer_membership
    member = trainer_membership(SampleBuffer(BufferConfig(sys.argv[1], sys.argv[2])))
    member.join(lambda _holder: end_on_lost(member))
    print("joined", flush=True)
    time.sleep(120)
    """
)


def test_a_redis_restarted_empty_mid_run_stops_the_trainer_with_exit_1_naming_what_was_lost(
    redis_alone: RedisServer, start_service
) -> None:
    url, run = redis_alone.url, "restarted"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_MEMBER, url, run],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = trainer.stdout
    assert out is not None
    broker = start_service("broker", ["broker", "--port", "0", "--redis-url", url, "--run-id", run])
    restarted = None
    try:
        wait_until(lambda: out.readline().strip() == "joined", "the trainer to join")
        assert httpx.get(f"{broker.url}/health").status_code == 200
        restarted = restart_empty(redis_alone)
        said = trainer.communicate(timeout=60)[0]

        def broker_stopped() -> str:
            reply = httpx.get(f"{broker.url}/health")
            return reply.json().get("problem", "") if reply.status_code == 503 else ""

        problem = wait_until(broker_stopped, "the broker to stop, naming the lost store")
    finally:
        trainer.kill()
        if restarted is not None:
            restarted.stop()
    assert trainer.returncode == 1, said
    assert "lost this run's state" in said and "tandem up --resume" in said
    assert "trained groups" in said and "appendonly yes" in said
    assert "lost this run's state" in problem


def test_at_its_memory_limit_the_watchdog_names_the_store_not_a_service(
    redis_alone: RedisServer,
) -> None:
    from tandem.watchdog import Watchdog

    buffer = SampleBuffer(BufferConfig(redis_alone.url, "full"))
    buffer.redis.set("ballast", b"x" * (8 << 20))
    used = buffer.redis.info("memory")["used_memory"]
    buffer.redis.config_set("maxmemory-policy", "noeviction")
    watchdog = Watchdog(buffer, {}, 1.0, 100.0, print)
    buffer.redis.config_set("maxmemory", str(int(used / 0.95)))  # near it: writes still taken
    lines = watchdog.report(stalled=60.0)
    (redis_line,) = [line for line in lines if line.startswith("  redis:")]
    assert "of its maxmemory" in redis_line and "raise maxmemory" in redis_line, lines
    broker = next(line for line in lines if line.startswith("  broker:"))
    assert "Redis is the cause" in broker and "starting, or stuck" not in broker
    buffer.redis.config_set("maxmemory", str(4 << 20))  # below what it holds: writes refused
    lines = watchdog.report(stalled=60.0)
    (redis_line,) = [line for line in lines if line.startswith("  redis:")]
    assert "refuses writes" in redis_line and "raise maxmemory" in redis_line, lines
    assert "Redis is the cause" in next(line for line in lines if line.startswith("  broker:"))


def test_an_unbalanced_ledger_fails_a_run_that_reached_max_steps(
    buffer: SampleBuffer, tmp_path: Path
) -> None:
    from tandem.up_run import UpRun

    run = UpRun.__new__(UpRun)  # (only what write_ledger reads: the outcome and the folder)
    run.run_dir, run.outcome = tmp_path, "max_steps"
    run.write_ledger(buffer)  # nothing generated: balanced
    assert run.outcome == "max_steps"
    buffer.incr_counter("groups_generated", 3)  # an evicting Redis lost where they went
    run.write_ledger(buffer)
    assert run.outcome == "ledger_unbalanced"
    assert json.loads((tmp_path / "ledger.json").read_text())["balanced"] is False


def trainer_step(run_dir: Path) -> int:
    """The newest step in the run's metrics.jsonl (0 before the first)."""
    path, step = run_dir / "metrics.jsonl", 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # (a line being written)
            continue
        step = max(step, row["step"]) if row.get("source") == "trainer" else step
    return step


@pytest.mark.slow
def test_tandem_up_on_an_external_redis_restarted_empty_ends_with_exit_1_naming_the_loss(
    redis_alone: RedisServer, tmp_path: Path
) -> None:
    """Before, nothing noticed: every service wrote its keys again, the run ended max_steps
    with exit 0, groups trained twice and the prompt order restarted at draw 0."""
    run_dir = tmp_path / "run"
    flags = ["--redis-url", redis_alone.url, "--max-steps", "200", "--stop-accuracy", "0"]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(run_dir), *flags]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    restarted = None
    try:
        wait_until(lambda: trainer_step(run_dir) >= 5 or up.poll() is not None, "step 5", 600)
        assert up.poll() is None, up.communicate()[0]
        restarted = restart_empty(redis_alone)
        said = up.communicate(timeout=300)[0]
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
        if restarted is not None:
            restarted.stop()
    assert up.returncode == 1, said
    assert "lost this run's state" in said and "tandem up --resume" in said
    assert trainer_step(run_dir) < 200


@pytest.mark.slow
def test_tandem_up_on_an_external_redis_that_evicts_keys_exits_2_naming_the_setting(
    redis_alone: RedisServer, tmp_path: Path
) -> None:
    client = SampleBuffer(BufferConfig(redis_alone.url, "x")).redis
    client.config_set("maxmemory", str(256 << 20))
    client.config_set("maxmemory-policy", "allkeys-lru")
    flags = ["--redis-url", redis_alone.url, "--max-steps", "5", "--stop-accuracy", "0"]
    cmd = [sys.executable, "-m", "tandem.cli", "up", "--run-dir", str(tmp_path / "run"), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "maxmemory-policy allkeys-lru" in said and "noeviction" in said
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or trainer_step(tmp_path / "run") == 0
