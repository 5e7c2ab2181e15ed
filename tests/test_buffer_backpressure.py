"""The router's face of the sample buffer (AsyncSampleBuffer) and its depth bound
(backpressure.py), against a real Valkey server: what the router writes the trainer's
SampleBuffer reads, producers wait at --max-buffer-depth and go on when the trainer consumes,
and a session reward refused for a full buffer keeps its session for the retry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from proto import DropReason, DropRecord, Sample, SampleGroup
from proto.contract import RunContract, ServiceStatus
from proto.packed import groups_of
from services.rollout_router.backpressure import (
    PUTS_IN_FLIGHT,
    BufferBound,
    BufferFullError,
    depth_note,
)
from services.rollout_router.config import RolloutConfig, RouterConfig, SessionConfig
from services.rollout_router.gateway.routes_agent import router as agent_router
from services.rollout_router.gateway.sessions import AgentSessions
from services.rollout_router.rollout.progress import Demand, allowance
from services.rollout_router.samples import Partial
from services.sample_buffer import AsyncSampleBuffer, SampleBuffer


def group(group_id: str) -> SampleGroup:
    sample = Sample(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        response_logprobs=[-0.5, -0.25],
        loss_mask=[1, 1],
        reward=1.0,
        weight_version=3,
    )
    return SampleGroup(
        group_id=group_id,
        prompt="p",
        label="l",
        samples=[sample],
        weight_version=3,
        created_at=time.time(),
    )


@pytest.fixture
async def aio(buffer: SampleBuffer) -> AsyncIterator[AsyncSampleBuffer]:
    """The router's face of the test's buffer (same server, same run id)."""
    face = AsyncSampleBuffer(buffer.config)
    yield face
    await face.aclose()


def consume(buffer: SampleBuffer, n: int) -> None:
    """What the trainer does with n groups: read, count them consumed, ack."""
    entries = buffer.read_groups("trainer-0", n, block_ms=None)
    buffer.incr_counter("groups_consumed", len(entries))
    buffer.ack([entry_id for entry_id, _ in entries])


def test_the_staleness_reach_is_the_most_the_demand_gate_ever_allows() -> None:
    for batch, k, s in [(4, 1, 0), (4, 1, 1), (4, 2, 1), (3, 2, 3), (8, 3, 7)]:
        config = RouterConfig(rollout_batch_size=batch, num_steps_per_rollout=k, max_staleness=s)
        most = max(allowance(Demand(0, 0, 0, v, v), batch, k, s) for v in range(3 * k))
        assert config.staleness_reach() == most, (batch, k, s)


def test_a_depth_bound_below_the_rollout_batch_is_refused_naming_the_flags() -> None:
    config = RouterConfig(rollout_batch_size=8, max_buffer_depth=5, rollout=False)
    with pytest.raises(ValueError, match=r"--max-buffer-depth 5 is below the rollout batch size 8"):
        config.validate()
    assert RouterConfig(rollout_batch_size=8, rollout=False).buffer_depth_bound() == 32
    RouterConfig(rollout_batch_size=8, max_buffer_depth=0, rollout=False).validate()
    tight = RouterConfig(rollout_batch_size=8, max_buffer_depth=10, max_staleness=2)
    assert "raise --max-buffer-depth to 24" in depth_note(tight)
    assert depth_note(RouterConfig(rollout_batch_size=8, max_staleness=2)) == ""


async def test_what_the_router_writes_the_trainer_reads_and_the_ledger_counts(
    aio: AsyncSampleBuffer, buffer: SampleBuffer
) -> None:
    assert [await aio.start_group() for _ in range(3)] == [0, 1, 2]
    ids = await aio.put_groups([group("p0"), group("p1")])  # one PUT for both
    ids.append(await aio.put_group(group("s0")))  # an agent session's group: never started
    got = buffer.read_groups("trainer-0", 10, block_ms=None)
    assert [entry_id for entry_id, _ in got] == ids
    assert [g.group_id for _, g in got] == ["p0", "p1", "s0"]
    assert got[0][1].samples[0].response_logprobs == [-0.5, -0.25]
    counters = buffer.counters()
    assert counters["groups_put"] == 3 and counters["groups_generated"] == 4
    assert await aio.backlog() == 3 and (await aio.ledger()).in_flight == 1  # p2
    await aio.record_drop(
        DropRecord(source="router", reason=DropReason.CANCELLED, count=1, samples=2, group_id="p2"),
        give_back=2,
    )
    assert buffer.drop_counts() == {"cancelled": 1} == await aio.drop_counts()
    assert await aio.drop_counts("samples") == {"cancelled": 2}
    ledger = await aio.ledger()
    assert ledger == buffer.ledger() and ledger.balanced, ledger.sentence()
    assert (ledger.generated, ledger.dropped, ledger.in_flight) == (4, 1, 0)
    buffer.incr_counter("groups_consumed", 2)
    assert await aio.backlog() == 1 and await aio.depth() == 3
    assert await aio.start_group() == 2 and buffer.counters()["prompts_drawn"] == 3
    assert await aio.recover_in_flight("router") == 1  # p2 again, as after a killed router
    assert await aio.start_group() == 2 and (await aio.ledger()).in_flight == 1
    buffer.set_version("trainer", 5)
    assert await aio.get_version("trainer") == 5 and await aio.get_version("engines") == -1
    run = buffer.agree_contract(RunContract(rollout_batch_size=4), "router")  # (membership.py)
    assert run.rollout_batch_size == 4 and await aio.contract() == run
    buffer.set_status(ServiceStatus(role="router", state="generating"))
    assert (await aio.statuses())["router"].state == "generating"
    await aio.publish_metrics("router", 2, {"rollout/batch": 0.0})
    assert buffer.read_metrics()[-1][1].values == {"rollout/batch": 0.0}
    assert await aio.last_metrics_id() == buffer.last_metrics_id()


async def test_producers_wait_at_the_depth_bound_and_go_on_when_the_trainer_consumes(
    aio: AsyncSampleBuffer, buffer: SampleBuffer
) -> None:
    bound = BufferBound(aio, max_depth=3)
    heard: list[str] = []

    async def produce(name: str) -> str:
        async with bound.slot(None, heard.append) as put:
            return await put(group(name))

    for name in ("a", "b", "c"):
        await produce(name)
    waiting = asyncio.create_task(produce("d"))
    await asyncio.sleep(0.3)
    assert not waiting.done() and bound.waiting == 1
    assert heard[-1] == "buffer full (depth 3 of 3)"
    assert bound.sentence(await aio.backlog()) == "buffer full (depth 3 of 3)"
    await asyncio.to_thread(consume, buffer, 1)
    await asyncio.wait_for(waiting, 5)
    assert await aio.backlog() == 3 and bound.waiting == 0
    # A producer with a deadline is refused naming the flag, and its slot is not lost.
    with pytest.raises(BufferFullError, match=r"depth 3 of 3.*--max-buffer-depth"):
        async with bound.slot(0.2):
            pass
    await asyncio.to_thread(consume, buffer, 2)
    async with bound.slot(1.0):
        pass  # taken and left unused: given back
    assert [await produce(n) for n in ("e", "f")] and await aio.backlog() == 3


async def test_one_put_of_started_and_unstarted_groups_counts_each_group_once(
    aio: AsyncSampleBuffer, buffer: SampleBuffer
) -> None:
    assert await aio.start_group() == 0
    ids = await aio.put_groups([group("s0"), group("p0"), group("s0")])  # s0: never started
    # one entry, its groups in order
    assert len({i.split("/")[0] for i in ids}) == 1 and [i.split("/")[1] for i in ids] == list(
        "012"
    )
    assert await aio.depth() == 3 and await aio.redis.xlen(aio.samples_key) == 1
    ledger = await aio.ledger()
    assert (ledger.put, ledger.generated, ledger.in_flight) == (3, 3, 0), ledger.sentence()
    assert ledger.balanced and await aio.backlog() == 3


def xadd_calls(buffer: SampleBuffer) -> int:
    """XADDs the server ran (those of scripts included)."""
    return int(buffer.redis.info("commandstats").get("cmdstat_xadd", {}).get("calls", 0))


def script_calls(buffer: SampleBuffer) -> int:
    """Script calls the server ran (EVALSHA; EVAL when a script was not loaded yet)."""
    stats = buffer.redis.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


async def put_through(bound: BufferBound, k: int) -> str:
    """A producer: take a slot (waiting for room), put group `g{k}` in it."""
    async with bound.slot(None) as put:
        return await put(group(f"g{k}"))


async def test_puts_from_many_tasks_share_script_calls(
    aio: AsyncSampleBuffer, buffer: SampleBuffer
) -> None:
    bound = BufferBound(aio, max_depth=0)
    before = script_calls(buffer)
    ids = await asyncio.gather(*(put_through(bound, k) for k in range(200)))
    assert len(set(ids)) == 200 and buffer.counters()["groups_put"] == 200
    assert script_calls(buffer) - before < 100, "concurrent puts are written as group commits"
    got = buffer.read_groups("trainer-0", 300, block_ms=None)
    assert sorted(g.group_id for _, g in got) == sorted(f"g{k}" for k in range(200))


async def test_a_turns_puts_are_two_batches_under_way_at_once_and_each_group_is_put_once(
    aio: AsyncSampleBuffer, buffer: SampleBuffer, monkeypatch
) -> None:
    """The writer alternated with the server: all producers in one PUT, then all making their
    next groups while nobody wrote. Now a turn's queue is halved between two PUTs under way at
    once (PUTS_IN_FLIGHT), never more."""
    under_way, most, sizes = 0, 0, []
    put_batch = aio.put_batch

    async def counted(groups: list[Any]) -> tuple[list[str], int]:
        nonlocal under_way, most
        under_way += 1
        most, _ = max(most, under_way), sizes.append(len(groups))
        try:
            return await put_batch(groups)
        finally:
            under_way -= 1

    monkeypatch.setattr(aio, "put_batch", counted)
    bound = BufferBound(aio, max_depth=0)

    async def producer(p: int) -> list[str]:  # each puts 5 groups, one after the other
        return [await put_through(bound, p * 5 + k) for k in range(5)]

    ids = [i for put in await asyncio.gather(*(producer(p) for p in range(64))) for i in put]
    assert len(set(ids)) == 320 and buffer.counters()["groups_put"] == 320
    assert most == PUTS_IN_FLIGHT and sizes[:2] == [32, 32], sizes
    got = buffer.read_groups("trainer-0", 400, block_ms=None)
    assert sorted(g.group_id for _, g in got) == sorted(f"g{k}" for k in range(320))


async def test_producers_let_go_by_room_at_the_bound_put_in_one_turn_in_arrival_order(
    aio: AsyncSampleBuffer, buffer: SampleBuffer
) -> None:
    bound = BufferBound(aio, max_depth=16)
    await asyncio.gather(*(put_through(bound, k) for k in range(16)))  # the bound is reached
    waiting = [asyncio.create_task(put_through(bound, k)) for k in range(16, 48)]
    while bound.waiting < 32:
        await asyncio.sleep(0.01)
    before = xadd_calls(buffer)  # (a consume writes no entry)
    await asyncio.to_thread(consume, buffer, 16)  # room for 16 of the 32 in line
    await asyncio.wait_for(asyncio.gather(*waiting[:16]), 10)
    # (16 = SPLIT_MIN: the two halves are two PUTs under way at once, in the order sent)
    assert xadd_calls(buffer) - before == 2, "the producers let go together put two entries"
    assert bound.waiting == 16 and not any(task.done() for task in waiting[16:])
    in_stream = sorted(
        [g.group_id for _, g in groups_of(i, f[b"d"])]
        for i, f in buffer.redis.xrange(aio.samples_key)
    )
    assert in_stream == [[f"g{k}" for k in range(16, 24)], [f"g{k}" for k in range(24, 32)]]
    await asyncio.to_thread(consume, buffer, 100)
    await asyncio.wait_for(asyncio.gather(*waiting[16:]), 10)
    assert await aio.backlog() == 16 and bound.waiting == 0


async def test_a_reward_refused_for_a_full_buffer_keeps_its_session_for_the_retry(
    aio: AsyncSampleBuffer, buffer: SampleBuffer
) -> None:
    bound = BufferBound(aio, max_depth=1)
    config = SessionConfig(session_put_timeout_s=0.3)
    sessions = AgentSessions(config, None, bound, None, [], 2)  # type: ignore[arg-type]
    out: dict[str, Any] = {
        "text": "ok",
        "meta_info": {
            "output_token_logprobs": [[-0.1, 7, None]],
            "finish_reason": {"type": "stop"},
            "weight_version": "1",
        },
    }
    for sid in ("s1", "s2", "s3"):
        sessions.store.record(sid, [1, 2], Partial.of(out))
    app = FastAPI()
    app.include_router(agent_router)
    app.state.sessions, app.state.api_token = sessions, ""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:

        async def reward(sid: str, **extra: Any) -> httpx.Response:
            return await client.post(f"/sessions/{sid}/reward", json={"reward": 1.0, **extra})

        assert (await reward("s1")).json()["status"] == "put"
        # A group member that completes nothing needs no room: answered at once.
        pending = await reward("s2", group="g", group_size=2)
        assert pending.json()["status"] == "pending"
        started = time.monotonic()
        refused = await reward("s3", group="g", group_size=2)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert "buffer full (depth 1 of 1)" in refused.json()["detail"]
        assert time.monotonic() - started >= 0.3
        assert "s3" in sessions.store.sessions and buffer.counters()["groups_put"] == 1
        await asyncio.to_thread(consume, buffer, 1)
        again = await reward("s3", group="g", group_size=2)
        assert again.json()["status"] == "put" and again.json()["samples"] == 2
    got = buffer.read_groups("trainer-0", 10, block_ms=None)
    assert [g.group_id for _, g in got] == ["group-g"]


async def test_a_task_cancelled_in_the_middle_of_redis_calls_stops(aio: AsyncSampleBuffer) -> None:
    """redis.asyncio may swallow a cancel that lands mid-command; the buffer raises it again,
    so the router's loops stop when they are told to."""

    async def reads() -> None:
        while True:
            await aio.counters()
            await aio.get_version("trainer")
            await aio.start_group()

    for k in range(30):
        task = asyncio.create_task(reads())
        await asyncio.sleep(0.002 + (k % 7) * 0.001)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert done and task.cancelled(), f"cancel {k} was lost"


async def test_a_group_whose_start_is_on_its_way_when_the_rollout_stops_is_recorded_cancelled(
    buffer: SampleBuffer, aio: AsyncSampleBuffer
) -> None:
    """The stop came while a group's START (counted generated and in flight) had run on the
    server and its reply was on its way: no task held the group, so nothing recorded it and
    the ledger of a finished run said `in flight 1`. Now it is a `cancelled` drop."""
    from proto.run_terms import RunTerms
    from services.rollout_router.config import SamplingConfig
    from services.rollout_router.rollout.loop import RolloutLoop

    loop = RolloutLoop(RunTerms(), RolloutConfig(), SamplingConfig(), None, aio, None, None, [])  # type: ignore[arg-type]
    real, ran = aio.start_group, asyncio.Event()

    async def reply_on_its_way() -> int:
        p = await real()
        ran.set()
        await asyncio.sleep(0.2)
        return p

    aio.start_group = reply_on_its_way  # type: ignore[method-assign]
    start = asyncio.create_task(loop._start_one())
    await ran.wait()
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await loop._cancel_groups()  # (the loop's stop: it waits for the drops being written)
    ledger = buffer.ledger()
    assert (ledger.generated, ledger.in_flight, ledger.dropped_groups) == (1, 0, {"cancelled": 1})
    assert ledger.balanced


async def test_room_learned_from_a_put_during_a_read_of_the_counters_is_not_counted_twice() -> None:
    """The writer lets producers go on the backlog its put returns while the slot granter's
    read of the counters is under way: that read must not hand their slots out again."""

    class Buffer:  # the buffer's two answers, each held until the test lets it through
        samples_key = "k"

        def __init__(self) -> None:
            self.written, self.consumed = 3, 0  # three groups wait for the trainer
            self.permits: asyncio.Queue[None] = asyncio.Queue()
            self.read = asyncio.Event()

        async def put_batch(self, groups: list[Any]) -> tuple[list[str], int]:
            await self.permits.get()
            self.written += len(groups)
            return [f"1-{self.written}/{i}" for i in range(len(groups))], self.backlog_now()

        def backlog_now(self) -> int:
            return self.written - self.consumed

        async def backlog(self) -> int:
            await self.read.wait()
            return self.backlog_now()

    buffer = Buffer()
    bound = BufferBound(buffer, max_depth=4)  # type: ignore[arg-type]
    holding: set[str] = set()  # producers with a slot whose group is not yet written

    async def produce(name: str) -> None:
        async with bound.slot(None) as put:
            holding.add(name)
            await put(group(name))
            holding.discard(name)

    buffer.read.set()
    tasks = [asyncio.create_task(produce("p1"))]  # room for one: it waits in its put
    await asyncio.sleep(0.05)
    buffer.read.clear()  # the next read of the counters hangs
    tasks += [asyncio.create_task(produce(f"p{i}")) for i in range(2, 7)]
    await asyncio.sleep(0.05)
    assert holding == {"p1"}
    buffer.consumed = 3  # the trainer consumes the three: p1's put returns a backlog of 1
    buffer.permits.put_nowait(None)
    await asyncio.sleep(0.05)
    assert len(holding) == 3, "the put's reply let three go"
    buffer.read.set()  # the read returns: room 4 - 1 - p1's slot, but three went meanwhile
    await asyncio.sleep(0.05)
    assert len(holding) + buffer.backlog_now() == 4, "never more than the bound"
    for _ in range(8):
        buffer.permits.put_nowait(None)
    buffer.consumed = 99
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
