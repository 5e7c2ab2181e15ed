"""The run's ledger: every generated group has one fate (trained, dropped, buffered, in flight),
the counts balance, and a router killed mid-run resumes without replaying or losing a group."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import redis

from proto import DropReason, DropRecord, Sample, SampleGroup
from proto.contract import ContractMismatchError, RunContract
from services.rollout_router.lease import RouterLease
from services.sample_buffer import AsyncSampleBuffer, BufferConfig, RedisServer, SampleBuffer
from services.sample_buffer.keys import LEASE_TTL_S, lease_owner_name
from services.sample_buffer.ledger import fenced_by
from services.sample_buffer.membership import Membership
from tandem.run_redis import run_id_of
from tests.helpers import router_args, wait_until

MAX_STALENESS = 1
BATCH = 4


def make_group(group_id: str, version: int = 0, n: int = 2) -> SampleGroup:
    sample = Sample(
        prompt_ids=[1, 4],
        response_ids=[6],
        response_logprobs=[-0.5],
        loss_mask=[1],
        reward=1.0,
        weight_version=version,
    )
    return SampleGroup(
        group_id=group_id,
        prompt="1>",
        label="1",
        samples=[sample] * n,
        weight_version=version,
        created_at=time.time(),
    )


def tandem_ledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "ledger", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_each_event_keeps_the_ledger_balanced_and_tandem_ledger_says_so(
    buffer: SampleBuffer,
) -> None:
    draws = [buffer.start_group() for _ in range(4)]  # the router starts p0..p3
    assert draws == [0, 1, 2, 3] and buffer.ledger().in_flight == 4
    buffer.put_group(make_group("p0"))
    buffer.put_group(make_group("p1"))
    router = "router"
    buffer.record_drop(DropRecord(source=router, reason=DropReason.ENGINE_ERROR, group_id="p2"))
    cancel = DropRecord(source=router, reason=DropReason.CANCELLED, samples=2, group_id="p3")
    buffer.record_drop(cancel, give_back=3)
    one = DropRecord(source=router, reason=DropReason.REWARD_ERROR, count=0, samples=1)
    buffer.record_drop(one)  # one sample of a group that is still put: no group's fate
    assert buffer.start_group() == 3, "the given-back draw comes first"
    assert buffer.counters()["prompts_drawn"] == 4
    assert buffer.ledger().balanced, buffer.ledger().table()
    # The trainer: p0 is dropped stale, p1 trained; then p3 is put and an agent's group too.
    read = buffer.read_groups("trainer", 2, block_ms=100)
    stale = DropRecord(source="trainer", reason=DropReason.STALE, samples=2, group_id="p0")
    buffer.record_drop(stale)
    buffer.incr_counter("groups_consumed", 2)
    assert buffer.record_trained(1, ["p1"]).balanced
    buffer.ack([entry for entry, _ in read])
    buffer.put_group(make_group("p3"))
    buffer.put_group(make_group("session-a"))  # never started: generated when put
    ledger = buffer.ledger()
    print(ledger.table())
    assert (ledger.generated, ledger.trained, ledger.dropped, ledger.buffered) == (6, 1, 3, 2)
    assert ledger.in_flight == 0 and ledger.balanced and ledger.violations == 0
    assert ledger.dropped_groups == {"engine_error": 1, "cancelled": 1, "stale": 1}
    assert ledger.dropped_samples == {"cancelled": 2, "stale": 2, "reward_error": 1}

    where = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    done = tandem_ledger(*where)
    assert done.returncode == 0 and "balanced" in done.stdout, done.stdout + done.stderr
    assert "stale" in done.stdout and "engine_error" in done.stdout
    buffer.incr_counter("groups_generated")  # a group nobody accounts for
    assert not buffer.record_trained(2, []).balanced
    assert buffer.counters()["ledger_violations"] == 1
    done = tandem_ledger(*where)
    assert done.returncode == 1 and "UNBALANCED: difference 1" in done.stdout, done.stdout
    assert "violations" in done.stdout


def test_tandem_ledger_says_why_for_each_drop_reason_with_its_newest_detail(
    buffer: SampleBuffer, tmp_path: Path
) -> None:
    router, reward = "router", DropReason.REWARD_ERROR
    for detail in ["reward function score raised ValueError: 1", "did not return within 30s"]:
        buffer.record_drop(
            DropRecord(source=router, reason=reward, count=0, samples=1, detail=detail)
        )
    engine = DropRecord(source=router, reason=DropReason.ENGINE_ERROR, detail="HTTP 500: boom")
    buffer.start_group()
    buffer.record_drop(engine)
    where = ["--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id]
    done = tandem_ledger(*where)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    reward_row = next(i for i, line in enumerate(lines) if line.strip().startswith("reward_error"))
    assert lines[reward_row + 1].strip() == "the last: did not return within 30s"
    assert "the last: HTTP 500: boom" in done.stdout and "ValueError" not in done.stdout
    # A finished run's ledger.json (written with the details) says the same.
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.json").write_text(json.dumps(buffer.ledger(details=True).as_dict()))
    done = tandem_ledger(str(run))
    assert done.returncode == 0 and "the last: did not return within 30s" in done.stdout, (
        done.stdout + done.stderr
    )


def test_a_trainer_resumed_from_an_older_checkpoint_takes_back_what_it_counted_after_it(
    buffer: SampleBuffer,
) -> None:
    for draw in range(3):
        assert buffer.start_group() == draw
        buffer.put_group(make_group(f"p{draw}"))

    def consume(version: int) -> None:  # at `version`: p1 dropped stale, p2 trained
        buffer.set_version("trainer", version)
        stale = DropRecord(source="trainer", reason=DropReason.STALE, samples=2, group_id="p1")
        buffer.record_drop(stale)
        buffer.incr_counter("groups_consumed", 2)
        assert buffer.record_trained(version + 1, ["p2"]).balanced

    buffer.set_version("trainer", 0)
    buffer.incr_counter("groups_consumed", 1)
    buffer.record_trained(1, ["p0"])  # the checkpoint of version 1 holds consumed = 1
    consume(1)
    assert buffer.ledger().dropped_groups == {"stale": 1}
    buffer.rewind_trainer(1, 1)  # died before its next checkpoint; resumed at version 1
    ledger = buffer.ledger()
    assert (ledger.trained, ledger.dropped, ledger.buffered) == (1, 0, 2) and ledger.balanced
    consume(1)  # the same groups again: counted once
    ledger = buffer.ledger()
    assert (ledger.trained, ledger.dropped, ledger.buffered) == (2, 1, 0) and ledger.balanced
    assert ledger.dropped_samples == {"stale": 2} and ledger.violations == 0


async def test_a_batch_put_counts_each_group_once_and_a_full_server_takes_whole_batches_or_none(
    tmp_path: Path,
) -> None:
    with RedisServer(log_dir=tmp_path / "logs") as server:
        buf = AsyncSampleBuffer(BufferConfig(redis_url=server.url, run_id="batch"))
        blocking = SampleBuffer(BufferConfig(redis_url=server.url, run_id="batch"))
        assert [blocking.start_group() for _ in range(3)] == [0, 1, 2]
        # p0 twice (one flight ends, the other counts generated), an agent's group, p2 left
        batch = [make_group("p0"), make_group("p1"), make_group("p0"), make_group("agent-a")]
        assert len(await buf.put_groups(batch)) == 4
        ledger = blocking.ledger()
        assert (ledger.generated, ledger.put, ledger.in_flight) == (5, 4, 1) and ledger.balanced
        assert await buf.put_groups([]) == []

        # A server at its maxmemory refuses a batch's first XADD: nothing of it is written.
        # One that reaches the bound within a batch writes that batch whole.
        big = make_group("agent-b", n=1)
        big.samples[0].response_ids = [7] * 2000
        used = int(blocking.redis.info("memory")["used_memory"])
        blocking.redis.config_set("maxmemory", used + 1_000_000)
        blocking.redis.config_set("maxmemory-policy", "noeviction")
        refused = 0
        for _ in range(40):
            try:
                await buf.put_groups([big] * 20)
            except redis.ResponseError as exc:
                assert "maxmemory" in str(exc)
                refused += 1
        await buf.aclose()
        ledger = blocking.ledger()
        print(ledger.table())
        assert refused > 0 and ledger.balanced
        assert ledger.put == blocking.depth() == 4 + 20 * (40 - refused)


def test_a_run_folder_is_read_from_its_redis_data_and_a_step_is_written_once(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run7"
    with RedisServer(data_dir=run / "redis", log_dir=tmp_path / "logs") as server:
        buf = SampleBuffer(BufferConfig(redis_url=server.url, run_id="up-run7"))
        buf.start_group()
        assert buf.publish_metrics("trainer", 1, {"train/loss": 1.0}, once_per_step=True)
        assert not buf.publish_metrics("trainer", 1, {"train/loss": 2.0}, once_per_step=True)
        assert buf.publish_metrics("trainer", 2, {"train/loss": 3.0}, once_per_step=True)
        losses = [r.values["train/loss"] for _, r in buf.read_metrics()]
        assert losses == [1.0, 3.0], "a step trained again after a resume is not written twice"
        time.sleep(1.2)  # appendfsync everysec
    done = tandem_ledger(str(run))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "generated 1 = trained 0 + dropped 0 + buffered 0 + in flight 1" in done.stdout


def test_tandem_ledger_of_a_run_whose_tandem_up_was_killed_asks_its_gone_redis_once(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A killed tandem up leaves RUN/redis.url naming its Redis, gone with it: `tandem ledger
    RUN` asked it again for 5 s (an explicit --redis-url with nothing there, 10 s) before it
    said anything. A refused connection is not asked again: the run's saved data is read, and
    the console says why; with none left, exit 2 naming what to do."""
    from tandem import ledger_cli

    run = tmp_path / "run"
    with RedisServer(data_dir=run / "redis", log_dir=tmp_path / "logs") as server:
        SampleBuffer(BufferConfig(redis_url=server.url, run_id="up-run")).start_group()
        gone = server.url  # (stopped: its data written, as at a SIGTERM)
    (run / "redis.url").write_text(gone)
    (run / "redis.json").write_text(json.dumps({"url": gone, "run_id": "up-run", "own": True}))
    asked: list[str] = []
    ping = redis.Redis.ping

    def counted(client: redis.Redis, **kwargs: object) -> object:
        if client.get_connection_kwargs().get("port") == urlparse(gone).port:
            asked.append(gone)
        return ping(client, **kwargs)

    monkeypatch.setattr(redis.Redis, "ping", counted)
    assert ledger_cli.main([str(run)]) == 0
    said = capsys.readouterr()
    assert "in flight 1: balanced" in said.out
    assert f"the run's Redis at {gone} is not running (connection refused)" in said.err
    assert f"reading its saved data ({run}/redis)" in said.err and asked == [gone]
    # no saved data left either: exit 2, naming what to do
    shutil.rmtree(run / "redis")
    asked.clear()
    assert ledger_cli.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert f"the run's Redis at {gone} is not running (connection refused)" in err
    assert "no redis/ data or ledger.json" in err and "--redis-url" in err and asked == [gone]
    asked.clear()
    assert ledger_cli.main(["--redis-url", gone, "--run-id", "up-run"]) == 2
    err = capsys.readouterr().err
    assert f"the Redis at {gone} is not running (connection refused)" in err, err
    assert "--redis-url" in err and asked == [gone]


def test_tandem_ledger_on_a_run_id_that_redis_does_not_hold_exits_2_naming_the_runs_there(
    buffer: SampleBuffer,
) -> None:
    """A mistyped --run-id printed an empty ledger, 'balanced', exit 0 (metrics and timeline
    refuse it naming the runs there)."""
    buffer.agree_contract(RunContract(rollout_batch_size=4), "router")
    buffer.start_group()
    done = tandem_ledger("--redis-url", buffer.config.redis_url, "--run-id", "no-such-run")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no run 'no-such-run'" in done.stderr and buffer.config.run_id in done.stderr
    assert "--run-id" in done.stderr and "balanced" not in done.stdout
    done = tandem_ledger("--redis-url", buffer.config.redis_url, "--run-id", buffer.config.run_id)
    assert done.returncode == 0 and "in flight 1: balanced" in done.stdout, done.stdout


def test_runs_on_a_shared_redis_get_their_own_ids_and_tandem_ledger_finds_them(
    tmp_path: Path, redis_server
) -> None:
    """Two `tandem up --redis-url` runs in folders of one name (a/run, b/run) were one run id
    (`up-run`): the second's trainer met the first's steps and refused to start. A new run on
    a shared Redis gets an id of its own, saved in its folder (redis.json): a resume and
    `tandem ledger RUN` read it there."""
    first, second = tmp_path / "a" / "run", tmp_path / "b" / "run"
    ids = {run_id_of(first, external=True, new=True), run_id_of(second, external=True, new=True)}
    assert len(ids) == 2 and all(i.startswith("up-run-") for i in ids)
    assert run_id_of(first, new=True) == "up-run"  # its own Redis, in the folder: no clash
    first.mkdir(parents=True)
    run_id = ids.pop()
    info = {"url": redis_server.url, "run_id": run_id, "own": False}
    (first / "redis.json").write_text(json.dumps(info))
    assert run_id_of(first) == run_id  # (a resume)
    SampleBuffer(BufferConfig(redis_url=redis_server.url, run_id=run_id)).start_group()
    done = tandem_ledger(str(first))
    assert "generated 1 = trained 0 + dropped 0 + buffered 0 + in flight 1" in done.stdout


class PlayTrainer:
    """Plays the trainer through the SampleBuffer API it uses: reads BATCH groups, drops the
    stale ones, 'trains' the rest (counts them consumed, records them trained, which checks
    the ledger), raises the version, moves the engine to it, acks."""

    def __init__(self, buffer: SampleBuffer, engine_url: str) -> None:
        self.buffer, self.engine_url = buffer, engine_url
        self.version = 0
        self.seen: list[str] = []  # every group id read, in order
        self.unbalanced: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        buffer, hand = self.buffer, []
        while not self.stop.is_set():
            hand += buffer.read_groups("trainer", BATCH - len(hand), block_ms=100)
            if len(hand) < BATCH:
                continue
            fresh = []
            for _entry, group in hand:
                self.seen.append(group.group_id)
                if self.version - group.weight_version > MAX_STALENESS:
                    record = DropRecord(
                        source="trainer",
                        reason=DropReason.STALE,
                        samples=len(group.samples),
                        group_id=group.group_id,
                    )
                    buffer.record_drop(record)
                else:
                    fresh.append(group.group_id)
            buffer.incr_counter("groups_consumed", len(hand))
            self.version += 1
            ledger = buffer.record_trained(self.version, fresh)
            if not ledger.balanced:
                self.unbalanced.append(ledger.sentence())
            buffer.set_version("trainer", self.version)
            body = {"model_path": "m", "weight_version": str(self.version)}
            httpx.post(self.engine_url + "/update_weights_from_disk", json=body, timeout=10)
            buffer.set_version("engines", self.version)
            buffer.ack([entry for entry, _ in hand])
            hand = []

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_a_router_killed_mid_run_resumes_without_replaying_losing_or_a_stale_burst(
    buffer, toy_model_dir, start_service, engines
):
    engine = engines("--delay-ms", "100")  # groups stay in flight long enough to be killed
    flags = ["--max-staleness", str(MAX_STALENESS), "--eval-interval", "0"]
    args = router_args(buffer, toy_model_dir, [engine.url], *flags, batch=BATCH)
    trainer = PlayTrainer(buffer, engine.url)
    try:
        first = start_service("router", args)
        wait_until(lambda: trainer.version >= 2, "two steps before the kill")
        wait_until(lambda: buffer.ledger().in_flight >= 2, "groups in flight to kill")
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        left = {k.decode() for k in buffer.redis.hkeys(buffer.in_flight_key)}
        at_kill = buffer.ledger()
        assert at_kill.balanced, at_kill.table()  # the groups it left are still in flight
        drawn_at_kill, steps_at_kill = buffer.counters()["prompts_drawn"], trainer.version

        second = start_service("router", args)
        wait_until(lambda: trainer.version >= steps_at_kill + 3, "three more steps")
        wait_until(lambda: left <= set(trainer.seen), "the killed groups' prompts put again")
        status = httpx.get(second.url + "/rollout/status", timeout=10).json()
        assert status["ledger"]["generated"] > at_kill.generated, status
    finally:
        trainer.close()
    os.killpg(second.proc.pid, signal.SIGKILL)  # killed again: what it had in flight stays so
    second.proc.wait()
    ledger = buffer.ledger()
    print(f"\nleft in flight by the kill: {sorted(left)}; at the kill:\n{at_kill.table()}")
    print(f"after the restart ({trainer.version} steps):\n{ledger.table()}")
    assert len(trainer.seen) == len(set(trainer.seen)), "a group id was put twice"
    assert ledger.dropped_groups.get("cancelled", 0) >= len(left)
    assert ledger.dropped_groups.get("stale", 0) <= BATCH, "a burst of stale groups"
    assert buffer.counters()["prompts_drawn"] > drawn_at_kill, "the cursor went on"
    assert not trainer.unbalanced and ledger.violations == 0, trainer.unbalanced
    assert ledger.balanced, ledger.table()


def test_a_second_router_on_a_running_run_is_refused_naming_the_first_and_takes_nothing(
    buffer, toy_model_dir, start_service, engines
):
    """One router per run: a second one (by hand, a service scaled to two) used to drop the
    first one's groups in flight as a dead router's and draw them again (trained twice)."""
    engine = engines("--delay-ms", "100")
    args = router_args(buffer, toy_model_dir, [engine.url], "--eval-interval", "0", batch=BATCH)
    first = start_service("router", args)
    wait_until(lambda: buffer.ledger().in_flight >= 2, "groups in flight")
    second = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 2, second.stderr[-2000:]
    last = second.stderr.strip().splitlines()[-1]
    assert f"another router holds run {buffer.config.run_id}: router pid {first.proc.pid}" in last
    assert "give this one another --run-id" in last
    assert "cancelled" not in buffer.ledger().dropped_groups
    assert httpx.get(first.url + "/health", timeout=10).status_code == 200


def test_a_router_stopped_past_its_lease_is_taken_over_and_writes_nothing_when_it_goes_on(
    buffer, toy_model_dir, start_service, engines
):
    engine = engines("--delay-ms", "100")
    flags = ["--max-staleness", str(MAX_STALENESS), "--eval-interval", "0"]
    args = router_args(buffer, toy_model_dir, [engine.url], *flags, batch=BATCH)
    trainer = PlayTrainer(buffer, engine.url)
    try:
        first = start_service("router", args)
        wait_until(lambda: trainer.version >= 2, "two steps")
        wait_until(lambda: buffer.ledger().in_flight >= 2, "groups in flight")
        os.killpg(first.proc.pid, signal.SIGSTOP)
        start_service("router", args)  # waits out the lease, takes the stopped one's groups
        steps = trainer.version
        wait_until(lambda: trainer.version >= steps + 2, "steps of the second router")
        os.killpg(first.proc.pid, signal.SIGCONT)
        health = wait_until(
            lambda: (r := httpx.get(first.url + "/health", timeout=10)).status_code == 503 and r,
            "the first router to fail its health",
        )
        assert "another router" in health.json()["error"], health.json()
        steps = trainer.version
        wait_until(lambda: trainer.version >= steps + 2, "more steps of the second router")
    finally:
        trainer.close()
    ledger = buffer.ledger()
    print(f"\nafter the takeover ({trainer.version} steps):\n{ledger.table()}")
    assert len(trainer.seen) == len(set(trainer.seen)), "a group id was put twice"
    assert ledger.dropped_groups.get("cancelled", 0) >= 2  # the stopped one's, taken over
    assert not trainer.unbalanced and ledger.violations == 0, trainer.unbalanced
    assert ledger.balanced, ledger.table()


def test_a_router_whose_lease_another_holds_writes_nothing(buffer):
    """ledger.FENCE: a router stopped past its lease, going on, draws, puts and drops
    nothing; writers that hold no lease (the trainer, tools) are not checked."""
    buffer.redis.set(buffer.lease_key, "router pid 1 on a")
    buffer.lease_owner = "router pid 2 on b"
    before = buffer.ledger()
    drop = DropRecord(source="router", reason=DropReason.ENGINE_ERROR, group_id="p0")
    writes = (
        buffer.start_group,
        lambda: buffer.put_groups([make_group("p0")]),
        lambda: buffer.record_drop(drop, give_back=0),
    )
    for write in writes:
        with pytest.raises(redis.ResponseError, match="held by another: router pid 1") as refused:
            write()
        # (the router reads it as its run taken over, not as Redis down: it had retried it)
        assert fenced_by(refused.value) == "router pid 1 on a"
    assert buffer.ledger() == before and buffer.redis.zcard(buffer.redraw_key) == 0
    buffer.lease_owner = ""
    assert buffer.start_group() == 0
    buffer.lease_owner = "router pid 1 on a"  # the holder writes
    buffer.put_groups([make_group("p0")])
    assert buffer.ledger().put == 1
    # a launcher gives up the lease of its child that died (of this host's pid only)
    buffer.release_lease_of("router", 1)  # held by "router pid 1 on a": another host's
    assert buffer.redis.get(buffer.lease_key) == b"router pid 1 on a"
    mine = lease_owner_name("router")
    buffer.redis.set(buffer.lease_key, mine)
    buffer.release_lease_of("router", os.getpid() + 1)
    assert buffer.redis.get(buffer.lease_key) == mine.encode()
    buffer.release_lease_of("router", os.getpid())
    assert buffer.redis.get(buffer.lease_key) is None


def test_a_service_whose_terms_contradict_the_run_gives_its_lease_up_at_once(
    buffer: SampleBuffer,
) -> None:
    """`Membership.join` takes the lease, fences the member's writes with it, then agrees its
    terms of the run contract: a contradiction (exit 2, naming the flag) gives the lease up
    at once, so the start with the flag fixed does not wait the lease out."""
    buffer.agree_contract(RunContract(weight_transport="nccl"), "trainer")
    key = buffer.lease_prefix + "broker"
    refused = Membership(SampleBuffer(buffer.config), "broker", lambda _said: None)
    with pytest.raises(ContractMismatchError, match="--weight-transport"):
        refused.join(lambda _holder: None, RunContract(weight_transport="zmq"))
    assert buffer.redis.get(key) is None
    member = Membership(SampleBuffer(buffer.config), "broker", lambda _said: None)
    run = member.join(lambda _holder: None, RunContract(weight_transport="nccl"))
    assert run is not None and run.weight_transport == "nccl"
    assert buffer.redis.get(key) == member.owner.encode()
    assert (member.buffer.lease_key, member.buffer.lease_owner) == (key, member.owner)
    assert member.release() == "" and buffer.redis.get(key) is None


def test_a_router_holds_its_lease_while_its_event_loop_is_busy(buffer: SampleBuffer) -> None:
    """The router renews its lease from a thread, from the moment it takes it: its start-up
    (tokenizer, task, reward) had taken longer than the expiry on a loaded machine before the
    renewing began, and a second router found the lease free (both ran, one fenced)."""

    async def take_then_block() -> tuple[bytes | None, str, bytes | None]:
        aio = AsyncSampleBuffer(buffer.config)
        lease = RouterLease(aio)
        await lease.take()
        time.sleep(LEASE_TTL_S + 1.5)  # blocks the event loop, as a slow start-up did
        held = buffer.redis.get(buffer.lease_prefix + "router")
        await lease.release()
        await aio.aclose()
        return held, lease.member.owner, buffer.redis.get(buffer.lease_prefix + "router")

    held, owner, after = asyncio.run(take_then_block())
    assert held is not None and held.decode() == owner, "the lease lapsed"
    assert after is None, "the lease was not given up at the stop"
    # a trainer's step, fenced by the trainer lease
    buffer.lease_key, buffer.lease_owner = buffer.lease_prefix + "trainer", "trainer pid 3 on b"
    buffer.redis.set(buffer.lease_key, "trainer pid 4 on c")
    with pytest.raises(redis.ResponseError, match="held by another: trainer pid 4"):
        buffer.record_trained(1, ["p0"], 1)
    assert buffer.ledger().trained == 0
