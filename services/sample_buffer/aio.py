"""AsyncSampleBuffer: the router's face of the sample buffer, on redis.asyncio.

The same keys, writes and decoding as `SampleBuffer` (keys.py), as coroutines, so that the
router's event loop never blocks on Redis nor hands a call to a thread. It has what the router
does with the buffer: start groups, put groups (several in one script call), record drops
and give prompts back, recover what a killed router left in flight, read the ledger, counters
and the backlog, versions, statuses, the run contract, and metrics. Every write the ledger
counts runs its Lua script (ledger.py), registered on this client as on the blocking one. The
trainer's consumer side (read, ack, trained lineage) stays in the blocking `SampleBuffer`, and
so do the run membership's lease, contract terms and status writes (membership.py: the router
hands those to a thread).
Nothing here waits for room: the router's depth bound (rollout_router/backpressure.py) decides
when a group may be put.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proto import DropRecord, MetricsRecord, SampleGroup
from proto.contract import RunContract, SampleLimits, ServiceStatus
from proto.packed import PackedGroup
from services.sample_buffer import keys, ledger, recovery
from services.sample_buffer.buffer import BufferConfig
from services.sample_buffer.keys import BufferKeys
from services.sample_buffer.ledger import Ledger
from services.sample_buffer.password import password_refusal

T = TypeVar("T")


async def io(call: Awaitable[T]) -> T:
    """Await one Redis call, then raise the cancellation redis-py lost: redis.asyncio (8.1, on
    Python 3.11) swallows a task's CancelledError that arrives mid-command, and a loop around
    its calls would then never stop. A task with a cancel pending never goes on from here,
    whether the call returned or raised (a Redis that is down: the loop would catch the
    RedisError and go on, and a service stopping with Redis dead waited for it for good)."""
    try:
        return await call
    finally:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError  # (over the call's own error, if any)


class AsyncSampleBuffer(BufferKeys):
    """One run's keys through an asyncio client (one per event loop)."""

    def __init__(self, config: BufferConfig, client: aioredis.Redis | None = None) -> None:
        super().__init__(config.run_id)
        self.config = config
        self.redis = client or aioredis.Redis.from_url(config.redis_url, **config.client_options())
        self.scripts = {
            "start": self.redis.register_script(ledger.START),
            "put": self.redis.register_script(ledger.PUT),
            "drop": self.redis.register_script(ledger.DROP),
            "lease": self.redis.register_script(ledger.LEASE),
            "release": self.redis.register_script(ledger.RELEASE),
        }

    async def aclose(self) -> None:
        await self.redis.aclose()  # closing: no cancel to keep

    async def ping(self) -> None:
        await io(self.redis.ping())

    async def wait_writable(self, every_s: float = 1.0) -> None:
        """Until Redis takes a write: a connection back is not enough, a server refusing writes
        (refusals.py: its disk full) answers PING, and the rollout that waited on PING went on
        making groups that could not be put, each dropped."""
        while True:
            try:
                await io(self.redis.set(self.probe_key, 1, px=10_000))
                return
            except RedisError:
                await asyncio.sleep(every_s)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Ping until the server answers; raise naming the URL if it never does."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                await io(self.redis.ping())
                return
            except RedisConnectionError as exc:
                if refused := password_refusal(self.config.redis_url, exc):
                    raise refused from None
                last = exc
                await asyncio.sleep(0.1)
        raise ConnectionError(
            f"no Redis server answered at {self.config.redis_url} within {timeout_s:.0f}s "
            f"(last error: {last}); check --redis-url or REDIS_URL"
        )

    # --- samples ------------------------------------------------------------------------------

    async def depth(self) -> int:
        """Groups in the stream: produced and not yet acked."""
        pipe = self.redis.pipeline(transaction=True)
        self.queue_depth(pipe)
        return keys.depth_of(*await io(pipe.execute()))

    async def backlog(self) -> int:
        """Groups put and not yet consumed by the trainer (what --max-buffer-depth bounds):
        the two counters only (the router reads it while the buffer is full, often)."""
        names = ("groups_put", "groups_consumed")
        values = await io(self.redis.hmget(self.counters_key, names))
        return keys.backlog({n: int(v) for n, v in zip(names, values, strict=True) if v})

    async def put_batch(self, groups: list[SampleGroup | PackedGroup]) -> tuple[list[str], int]:
        """Append groups in one ledger PUT (one script call, atomic: the XADDs of their
        entries, the end of each group's flight, and `groups_put`); each group's key
        (`entry/index`), and the backlog after the put. The depth bound is the producer's (the
        router's backpressure.py)."""
        (script_keys, args), counts = ledger.put_call(self, groups)
        return ledger.put_reply(await io(self.scripts["put"](keys=script_keys, args=args)), counts)

    async def put_groups(self, groups: list[SampleGroup | PackedGroup]) -> list[str]:
        """`put_batch`'s keys."""
        return (await self.put_batch(groups))[0]

    async def put_group(self, group: SampleGroup | PackedGroup) -> str:
        return (await self.put_groups([group]))[0]

    # --- drops, the ledger ----------------------------------------------------------------------

    async def record_drop(
        self, record: DropRecord, give_back: int | None = None, forget: str = ""
    ) -> None:
        """As `SampleBuffer.record_drop` (one DROP script); `forget`: an open agent session or
        group (`note_open`) this drop ends, taken off that list in the same transaction."""
        script_keys, args = ledger.drop_call(self, record, self.config.drop_log_len, give_back)
        if not forget:
            await io(self.scripts["drop"](keys=script_keys, args=args))
            return
        pipe = self.redis.pipeline(transaction=True)
        await self.scripts["drop"](keys=script_keys, args=args, client=pipe)
        pipe.hdel(self.open_sessions_key, forget)
        await io(pipe.execute())

    async def note_open(
        self, held: dict[str, int] | None = None, gone: tuple[str, ...] = ()
    ) -> None:
        """The router's open agent sessions and the groups waiting for more of them (name ->
        samples held), kept in Redis as they open (`held`) and close (`gone`): a router killed
        before it records them dropped leaves them there for the next one (`recover_open`)."""
        pipe = self.redis.pipeline(transaction=True)
        if gone:
            pipe.hdel(self.open_sessions_key, *gone)
        if held:
            pipe.hset(self.open_sessions_key, mapping=held)
        await io(pipe.execute())

    async def recover_open(self, source: str) -> int:
        """At a router's start, the agent sessions and groups a killed one left open are
        dropped as `cancelled` (they vanished unrecorded). Returns how many."""
        left = await io(self.redis.hgetall(self.open_sessions_key))
        for name, samples in left.items():
            record = recovery.open_drop(source, name.decode(), int(samples))
            await self.record_drop(record, forget=name.decode())
        if left:
            ledger.log.warning(
                "%d agent sessions and groups were open when the last router died: dropped "
                "as cancelled",
                len(left),
            )
        return len(left)

    async def drop_counts(self, unit: str = "groups") -> dict[str, int]:
        """Drops by reason in `unit` ("groups" or "samples"); reasons at 0 are left out."""
        raw = keys.int_hash(await io(self.redis.hgetall(self.drops_key)))
        groups, samples = ledger.split_drops(raw)
        return {"groups": groups, "samples": samples}[unit]

    async def drop_log(self, count: int = 100) -> list[DropRecord]:
        return keys.drop_records(await io(self.redis.xrevrange(self.drop_log_key, count=count)))

    async def start_group(self) -> int:
        """As `SampleBuffer.start_group` (one START script): the draw, counted in flight."""
        script_keys, args = ledger.start_call(self)
        return int(await io(self.scripts["start"](keys=script_keys, args=args)))

    async def recover_in_flight(self, source: str) -> int:
        """As `recovery.recover_in_flight`: at a router's start, the groups a killed one left in
        flight are dropped (`cancelled`) and their prompts given back. Returns how many."""
        left = await io(self.redis.hgetall(self.in_flight_key))
        for group_id, draw in left.items():
            await self.record_drop(recovery.in_flight_drop(source, group_id), give_back=int(draw))
        if left:
            ledger.log.warning(
                "%d groups were in flight when the last router died: drawn again", len(left)
            )
        return len(left)

    async def ledger(self) -> Ledger:
        """Where every group went, as of now (one MULTI, as `ledger.read`)."""
        pipe = self.redis.pipeline(transaction=True)
        ledger.queue_read(self, pipe)
        return ledger.of_replies(*await io(pipe.execute()))

    # --- versions, counters ---------------------------------------------------------------------

    async def get_version(self, role: str, default: int = -1) -> int:
        return keys.version_of(await io(self.redis.get(self.version_prefix + role)), default)

    async def counters(self) -> dict[str, int]:
        return keys.int_hash(await io(self.redis.hgetall(self.counters_key)))

    async def incr_counter(self, name: str, amount: int = 1) -> int:
        return int(await io(self.redis.hincrby(self.counters_key, name, amount)))

    # --- run contract, status ------------------------------------------------------------------

    async def contract(self) -> RunContract:
        return keys.contract_of(await io(self.redis.hgetall(self.contract_key)))

    async def sample_limits(self) -> SampleLimits | None:
        """The longest sample the run's trainer takes; None before a trainer has started."""
        raw = await io(self.redis.get(self.limits_key))
        return None if raw is None else msgspec.json.decode(raw, type=SampleLimits)

    async def _scan(self, pattern: str) -> list[bytes]:
        return [name async for name in self.redis.scan_iter(pattern)]

    async def statuses(self) -> dict[str, ServiceStatus]:
        names = sorted(await io(self._scan(self.status_prefix + "*")))
        return keys.statuses_of(await io(self.redis.mget(names)) if names else [])

    # --- metrics ------------------------------------------------------------------------------

    async def publish_metrics(self, source: str, step: int, values: dict[str, float]) -> None:
        entry = self.metrics_entry(source, step, values)
        await io(
            self.redis.xadd(
                self.metrics_key, entry, maxlen=self.config.metrics_len, approximate=True
            )
        )

    async def last_metrics_id(self) -> str:
        return keys.newest_id(await io(self.redis.xrevrange(self.metrics_key, count=1)))

    async def read_metrics(
        self, after_id: str = "0", block_ms: int | None = None, count: int | None = None
    ) -> list[tuple[str, MetricsRecord]]:
        """Records after `after_id` (exclusive), oldest first; at most `count` when given."""
        reply = await io(
            self.redis.xread({self.metrics_key: after_id}, count=count, block=block_ms)
        )
        return keys.stream_entries(reply, MetricsRecord)
