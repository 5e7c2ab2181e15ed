"""SampleBuffer: sample groups, drops, versions and metrics of one run, kept in Redis.

Keys (all under `tandem:{run_id}:`):
- `samples`   stream of `SampleGroup`, consumer group `trainer`. The router XADDs; the trainer
              XREADGROUPs, and after training XACKs and XDELs. The router waits while the
              backlog (`groups_put - groups_consumed`, keys.py) is at `--max-buffer-depth`
              (backpressure): the buffer never grows without bound and nothing is trimmed
              away unseen.
- `drops`     hash reason -> count; `drop_log` stream of `DropRecord` (capped at `drop_log_len`,
              the counters are exact).
- `version:{role}`  integer weight version last reported by a role (trainer, engines).
- `metrics`   stream of `MetricsRecord` (capped at `metrics_len`).
- `contract`  hash term -> JSON value (`proto.contract.RunContract`), plus `by:{term}` naming the
              service that set it; written once per run, term by term (HSETNX).
- `counters`  hash name -> integer: `groups_put` (incremented in the same transaction as the
              XADD), and what the services count beside it (e.g. `groups_consumed`).
- `redraw`    sorted set of prompt draws given back (a group stopped before it was put): the
              next draws take them, lowest first, before the cursor `prompts_drawn` moves on.
- `status:{role}`  the `ServiceStatus` a service last reported (it expires when not refreshed).
- `trained`   hash trainer version -> JSON list of the group ids of the rollout whose last
              optimizer step made that version. A version trained again after a resume from an
              older checkpoint replaces its entry, so the hash describes the lineage of the
              newest weights: no id may appear twice in it.

A group read but not acked (trainer died mid-step) stays pending in the consumer group;
`read_groups(pending_first=True)` hands it out again, so no group is lost on restart.

Key names, writes and reply decoding live in keys.py, shared with the router's asyncio face
(aio.py); this class is the blocking one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import redis

from proto import DropRecord, MetricsRecord, SampleGroup
from proto.contract import RunContract, ServiceStatus
from services.sample_buffer import keys
from services.sample_buffer.keys import CONSUMER_GROUP, BufferKeys


@dataclass
class BufferConfig:
    """Where the buffer lives and how long its logs get (producers pass their own bound)."""

    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "Redis URL."})
    run_id: str = field(default="default", metadata={"help": "Key prefix: one run per id."})
    # Logs are for humans; exact counts live in the `drops` hash.
    drop_log_len: int = field(default=10_000, metadata={"help": "Drop records kept."})
    metrics_len: int = field(default=100_000, metadata={"help": "Metrics records kept."})


class SampleBuffer(BufferKeys):
    """Typed access to one run's keys. Thread-safe as far as redis-py clients are."""

    def __init__(self, config: BufferConfig, client: redis.Redis | None = None) -> None:
        super().__init__(config.run_id)
        self.config = config
        self.redis = client or redis.Redis.from_url(config.redis_url)

    # --- connection -------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Ping until the server answers; raise naming the URL if it never does."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.redis.ping()
                return
            except redis.ConnectionError as exc:
                last = exc
                time.sleep(0.1)
        raise ConnectionError(
            f"no Redis server answered at {self.config.redis_url} within {timeout_s:.0f}s "
            f"(last error: {last}); check --redis-url or REDIS_URL"
        )

    # --- samples ------------------------------------------------------------------------------

    def ensure_consumer_group(self) -> None:
        try:
            self.redis.xgroup_create(self.samples_key, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def depth(self) -> int:
        """Entries in the stream: groups produced and not yet acked."""
        return int(self.redis.xlen(self.samples_key))

    def backlog(self) -> int:
        """Groups put and not yet consumed by the trainer (what --max-buffer-depth bounds)."""
        return keys.backlog(self.counters())

    def put_group(self, group: SampleGroup) -> str:
        """Append a group (the router's depth bound is its own: rollout_router/backpressure.py).
        Returns the stream id."""
        pipe = self.redis.pipeline(transaction=True)
        self.queue_puts(pipe, [group])
        return keys.entry_id(pipe.execute()[0])

    def read_groups(
        self, consumer: str, count: int, block_ms: int = 1000, pending_first: bool = False
    ) -> list[tuple[str, SampleGroup]]:
        """Up to `count` groups for `consumer`. With `pending_first`, groups this consumer read
        earlier but never acked come first (resume after a crash)."""
        self.ensure_consumer_group()
        out: list[tuple[str, SampleGroup]] = []
        if pending_first:
            out += self._read(consumer, count, "0", None)
            count -= len(out)
        if count > 0:
            out += self._read(consumer, count, ">", block_ms)
        return out

    def _read(
        self, consumer: str, count: int, start: str, block_ms: int | None
    ) -> list[tuple[str, SampleGroup]]:
        reply = self.redis.xreadgroup(
            CONSUMER_GROUP, consumer, {self.samples_key: start}, count=count, block=block_ms
        )
        return keys.stream_entries(reply, SampleGroup)

    def ack(self, entry_ids: list[str]) -> None:
        """Mark groups as trained and delete them (this is what frees buffer space)."""
        if not entry_ids:
            return
        pipe = self.redis.pipeline()
        pipe.xack(self.samples_key, CONSUMER_GROUP, *entry_ids)
        pipe.xdel(self.samples_key, *entry_ids)
        pipe.execute()

    # --- drops --------------------------------------------------------------------------------

    def record_drop(self, record: DropRecord) -> None:
        pipe = self.redis.pipeline()
        self.queue_drop(pipe, record, self.config.drop_log_len)
        pipe.execute()

    def drop_counts(self) -> dict[str, int]:
        return keys.int_hash(self.redis.hgetall(self.drops_key))

    def drop_log(self, count: int = 100) -> list[DropRecord]:
        return keys.drop_records(self.redis.xrevrange(self.drop_log_key, count=count))

    # --- versions -----------------------------------------------------------------------------

    def set_version(self, role: str, version: int) -> None:
        self.redis.set(self.version_prefix + role, version)

    def get_version(self, role: str, default: int = -1) -> int:
        return keys.version_of(self.redis.get(self.version_prefix + role), default)

    # --- run contract, counters, status ---------------------------------------------------------

    def agree_contract(self, mine: RunContract, who: str) -> RunContract:
        """Set each term of `mine` that the run does not have yet, then check every term `mine`
        states against the run's. Returns the run's whole contract as it stands; raises
        `ContractMismatchError` (naming the flag) on the first contradiction."""
        pipe = self.redis.pipeline(transaction=True)
        self.queue_contract(pipe, mine, who)
        pipe.execute()
        return keys.check_contract(mine, self.redis.hgetall(self.contract_key), who)

    def contract(self) -> RunContract:
        """The run's contract as stated so far (terms nobody stated are None)."""
        return keys.contract_of(self.redis.hgetall(self.contract_key))

    def incr_counter(self, name: str, amount: int = 1) -> int:
        return int(self.redis.hincrby(self.counters_key, name, amount))

    def set_counter(self, name: str, value: int) -> None:
        self.redis.hset(self.counters_key, name, value)

    def counters(self) -> dict[str, int]:
        return keys.int_hash(self.redis.hgetall(self.counters_key))

    def draw_prompt(self) -> int:
        """The next prompt draw of the run: one given back first, else the cursor's next."""
        given_back = self.redis.zpopmin(self.redraw_key)
        if given_back:
            return int(given_back[0][1])
        return self.incr_counter("prompts_drawn") - 1

    def give_back_prompt(self, draw: int) -> None:
        """Draw `draw` was not used (its group stopped before it was put): draw it again."""
        self.redis.zadd(self.redraw_key, {str(draw): draw})

    def record_trained(self, step: int, group_ids: list[str]) -> None:
        self.redis.hset(self.trained_key, str(step), msgspec.json.encode(group_ids))

    def trained(self) -> dict[int, list[str]]:
        """Group ids trained at each optimizer step of the newest weights' lineage."""
        return keys.trained_of(self.redis.hgetall(self.trained_key))

    def set_status(self, status: ServiceStatus, ttl_s: float = 30.0) -> None:
        """Report what this service is doing; gone after `ttl_s` unless reported again."""
        key, value, ttl_ms = self.status_write(status, ttl_s)
        self.redis.set(key, value, px=ttl_ms)

    def statuses(self) -> dict[str, ServiceStatus]:
        """The last status of every service that reported one recently, by role."""
        names = sorted(self.redis.scan_iter(self.status_prefix + "*"))
        return keys.statuses_of(self.redis.mget(names) if names else [])

    # --- metrics ------------------------------------------------------------------------------

    def publish_metrics(self, source: str, step: int, values: dict[str, float]) -> None:
        entry = self.metrics_entry(source, step, values)
        self.redis.xadd(self.metrics_key, entry, maxlen=self.config.metrics_len, approximate=True)

    def last_metrics_id(self) -> str:
        """Id of the newest metrics record ("0" when there is none)."""
        return keys.newest_id(self.redis.xrevrange(self.metrics_key, count=1))

    def read_metrics(
        self, after_id: str = "0", block_ms: int | None = None
    ) -> list[tuple[str, MetricsRecord]]:
        """Records after `after_id` (exclusive), oldest first."""
        reply = self.redis.xread({self.metrics_key: after_id}, block=block_ms)
        return keys.stream_entries(reply, MetricsRecord)
