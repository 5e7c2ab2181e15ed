"""SampleBuffer: sample groups, drops, versions and metrics of one run, kept in Redis.

Keys (all under `tandem:{run_id}:`):
- `samples`   stream of entries of one or more groups (`d`: `proto.packed`, the groups of
              one PUT; a `SampleGroup` is read too; `n`: their count, the mark of the
              ledger's PUT or REPUT: an entry without it is foreign), consumer group
              `trainer`; `entry_groups` hash entry id -> its number of groups when more than
              one (`depth`). The router
              XADDs; the trainer XREADGROUPs, and once every group of an entry is trained
              (or dropped) XACKs and XDELs it (the ACK script). The router waits while the
              backlog (`groups_put - groups_consumed`, keys.py) is at `--max-buffer-depth`
              (backpressure, rollout_router/backpressure.py): the buffer never grows without
              bound and nothing is trimmed away unseen.
- `drops`     hash `{reason}:groups` and `{reason}:samples` -> count (each drop in its own
              unit); `drop_log` stream of `DropRecord` (capped at `drop_log_len`, the counters
              are exact).
- `version:{role}`  integer weight version last reported by a role (trainer, engines).
- `metrics`   stream of `MetricsRecord` (capped at `metrics_len`); `metrics_steps` hash source ->
              last step written once (`publish_metrics(once_per_step=True)`).
- `contract`  hash term -> JSON value (`proto.contract.RunContract`), plus `by:{term}` naming the
              service that set it; written once per run, term by term (HSETNX).
- `counters`  hash name -> integer: `groups_put` (incremented in the same script as the
              XADD), `groups_dead_lettered` (in the transaction of the move), and what the
              services count beside it (e.g. `groups_consumed`); the ledger's counters and
              `in_flight` hash: see `ledger.py`.
- `redraw`    sorted set of prompt draws given back (a group stopped before it was put): the
              next draws take them, lowest first, before the cursor `prompts_drawn` moves on.
- `status:{role}`  the `ServiceStatus` a service last reported (it expires when not refreshed).
- `trained`   hash trainer version -> JSON list of the group ids of the rollout whose last
              optimizer step made that version. A version trained again after a resume from an
              older checkpoint replaces its entry, so the hash describes the lineage of the
              newest weights: no id may appear twice in it. A resumed trainer removes the
              versions above its own (`rewind_trainer`).
- `limits`    JSON `proto.contract.SampleLimits`: the longest sample the trainer takes (set
              at its start), which the router's `PATCH /rollout/config` is held to.
- `dead_letter`  stream of entries the trainer would not train (capped at `dead_letter_len`):
              `reason` (a `proto.drops.DeadLetterReason`), `detail`, `entry_id` (its id in
              `samples`), and the entry's own fields as they were (`d` = the raw payload).

A group read but not acked (trainer died mid-step) stays pending in the consumer group;
`read_groups(pending_first=True)` hands it out again, so no group is lost on restart, and
`reclaim` (XAUTOCLAIM) moves the pending groups of a consumer gone for good to another. The
samples stream is never trimmed (no MAXLEN): an entry leaves it only by `ack` or `dead_letter`,
both of which ack it first.

Key names, writes and reply decoding live in keys.py (and the ledger's scripts in ledger.py),
shared with the router's asyncio face (aio.py); this class is the blocking one.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from proto import DropRecord, MetricsRecord, SampleGroup, decode
from proto.contract import RunContract, SampleLimits, ServiceStatus
from proto.packed import PackedGroup, encode_entry, groups_of, unpack
from proto.run_terms import RunPlace
from services.common.settings import Count, PositiveSeconds, Section
from services.sample_buffer import keys, ledger, recovery
from services.sample_buffer.keys import CONSUMER_GROUP, BufferKeys
from services.sample_buffer.ledger import Ledger
from services.sample_buffer.password import password_option, password_refusal
from services.sample_buffer.refusals import refusal


class BufferLimits(Section):
    """How long the run's Redis logs get and how long a Redis call may take (a service's
    `buffer` section; where the buffer lives is the run's: --redis-url, --run-id)."""

    # Logs are for humans; exact counts live in the `drops` hash.
    drop_log_len: Count = 10_000
    """Drop records kept."""
    metrics_len: Count = 100_000
    """Metrics records kept."""
    dead_letter_len: Count = 10_000
    """Dead-letter entries kept."""
    redis_call_timeout_s: PositiveSeconds = 10.0
    """Seconds a Redis call may take: a server that stops answering (a paused or partitioned
    host) fails the call then, and the service waits for Redis as for one that is down, saying
    so."""


class BufferConfig(BufferLimits, RunPlace):
    """Where the buffer lives, the run's `RunPlace` (also given as `BufferConfig(redis_url,
    run_id)`), and its limits (producers pass their own bound)."""

    def __init__(self, *place: str, **fields: Any) -> None:
        super().__init__(
            **dict[str, Any](zip(("redis_url", "run_id"), place, strict=False)), **fields
        )

    def validate(self) -> None:  # type: ignore[override]  # (pydantic's is a deprecated classmethod)
        # ("": the broker's, which publishes nowhere then)
        if self.redis_url and (problem := redis_url_problem(self.redis_url)):
            raise ValueError(problem)

    def client_options(self) -> dict[str, float | str]:
        """redis-py's socket timeouts (blocking reads must ask for less) and the password
        (TANDEM_REDIS_PASSWORD, password.py)."""
        return {
            "socket_timeout": self.redis_call_timeout_s,
            "socket_connect_timeout": self.redis_call_timeout_s,
            **password_option(),
        }


def redis_url_problem(url: str, flag: str = "--redis-url") -> str:
    """Why redis-py cannot use `url` ("" when it can), naming `flag`: a URL without its scheme
    (host:6379) or with another (http://) was a traceback where the client was made."""
    try:
        redis.connection.parse_url(url)
    except ValueError as exc:
        return f"{flag} {url!r}: {exc} (e.g. redis://127.0.0.1:6379/0)"
    return ""


Entry = tuple[str, dict[bytes, bytes]]  # a stream entry: id and raw fields
DEAD_LETTER_FIELDS = (b"reason", b"detail", b"entry_id")  # a letter's own fields


@dataclass
class DeadLetter:
    """One entry of the dead-letter stream."""

    entry_id: str  # its id in the samples stream
    reason: str  # a `proto.drops.DeadLetterReason`
    detail: str
    fields: dict[bytes, bytes]  # the entry's own fields (`d`: the payload) as they were


class SampleBuffer(BufferKeys):
    """Typed access to one run's keys. Thread-safe as far as redis-py clients are."""

    def __init__(self, config: BufferConfig, client: redis.Redis | None = None) -> None:
        super().__init__(config.run_id)
        self.config = config
        self.redis = client or redis.Redis.from_url(config.redis_url, **config.client_options())
        self.scripts = {
            "start": self.redis.register_script(ledger.START),
            "put": self.redis.register_script(ledger.PUT),
            "ack": self.redis.register_script(ledger.ACK),
            "step": self.redis.register_script(ledger.STEP),
            "reput": self.redis.register_script(ledger.REPUT),
            "drop": self.redis.register_script(ledger.DROP),
            "metrics_once": self.redis.register_script(ledger.METRICS_ONCE),
            "lease": self.redis.register_script(ledger.LEASE),
            "release": self.redis.register_script(ledger.RELEASE),
        }
        self._group_made = False  # the consumer group is known to exist (reads skip XGROUP)

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
                if refused := password_refusal(self.config.redis_url, exc):
                    raise refused from None
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
        self._group_made = True

    def depth(self) -> int:
        """Groups produced and not yet trained (acked)."""
        pipe = self.redis.pipeline(transaction=True)
        self.queue_depth(pipe)
        return keys.depth_of(*pipe.execute())

    def backlog(self) -> int:
        """Groups put and not yet consumed by the trainer (what --max-buffer-depth bounds)."""
        return keys.backlog(self.counters())

    def counters_and_depth(self) -> tuple[dict[str, int], int]:
        """`counters()` and `depth()` of one moment, in one round trip (the trainer's status
        while it waits, once per read)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.counters_key)
        self.queue_depth(pipe)
        raw, *depth = pipe.execute()
        return keys.int_hash(raw), keys.depth_of(*depth)

    def put_groups(self, groups: list[SampleGroup | PackedGroup]) -> list[str]:
        """Append groups (the router's depth bound is its own: rollout_router/backpressure.py)
        in one script: the XADDs of their entries, `groups_put` and the end of each group's
        flight (ledger.py). Returns each group's key (`entry/index`)."""
        (script_keys, args), counts = ledger.put_call(self, groups)
        return ledger.put_reply(self.scripts["put"](keys=script_keys, args=args), counts)[0]

    def put_group(self, group: SampleGroup | PackedGroup) -> str:
        return self.put_groups([group])[0]

    def read_groups(
        self, consumer: str, count: int, block_ms: int = 1000, pending_first: bool = False
    ) -> list[tuple[str, SampleGroup]]:
        """The groups of up to `count` entries for `consumer`, by key (`entry/index`), in list
        form (`proto.packed.unpack`). With `pending_first`, groups this consumer read earlier
        but never acked come first (resume after a crash)."""
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
        return [
            (key, unpack(group))
            for i, f in self.read_entries(consumer, count, start, block_ms)
            for key, group in groups_of(i, f[b"d"])
        ]

    def read_entries(
        self, consumer: str, count: int, start: str = ">", block_ms: int | None = None
    ) -> list[Entry]:
        """Up to `count` raw entries for `consumer`: new ones (`start` ">"), or this consumer's
        pending ones after `start` ("0" = all). A pending entry deleted meanwhile is acked."""
        if not self._group_made:  # once, not per read: a read is the trainer's hot path
            self.ensure_consumer_group()
        try:
            reply = self.redis.xreadgroup(
                CONSUMER_GROUP, consumer, {self.samples_key: start}, count=count, block=block_ms
            )
        except redis.ResponseError as exc:  # a server restarted without its data meanwhile
            return self.read_refused(exc)
        return self.entries_of(reply)

    def read_refused(self, exc: redis.ResponseError) -> list[Entry]:
        """A read refused for want of the consumer group (a server restarted without its
        data): none read, the group made again by the next read; other errors raise."""
        if "NOGROUP" not in str(exc):
            raise exc
        self._group_made = False
        return []

    def entries_of(self, reply: Any) -> list[Entry]:
        """The entries of an XREADGROUP's reply (redis-py's form); a pending entry deleted
        meanwhile is acked."""
        out, gone = [], []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                key = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if fields:
                    out.append((key, dict(fields)))
                else:  # pending entry deleted meanwhile
                    gone.append(key)
        if gone:
            self.redis.xack(self.samples_key, CONSUMER_GROUP, *gone)
        return out

    def reclaim(self, consumer: str, min_idle_ms: int) -> int:
        """Make every entry pending for `min_idle_ms` or longer (whichever consumer read it)
        pending for `consumer` (XAUTOCLAIM); `read_entries(start="0")` then hands them out.
        Returns how many were claimed."""
        self.ensure_consumer_group()
        claimed, start = 0, "0-0"
        while True:
            # (not JUSTID: redis-py then drops the cursor of the next call)
            reply = self.redis.xautoclaim(
                self.samples_key, CONSUMER_GROUP, consumer, min_idle_ms, start, 100
            )
            start = reply[0]
            claimed += len(reply[1])
            if start in (b"0-0", "0-0"):
                return claimed

    def pending_count(self) -> int:
        """Entries read by some consumer and not yet acked."""
        self.ensure_consumer_group()
        return int(self.redis.xpending(self.samples_key, CONSUMER_GROUP)["pending"])

    def ack(self, ids: list[str]) -> None:
        """Ack and delete the entries of `ids` (entry ids or group keys `entry/index`; a key
        acks its whole entry): what frees buffer space."""
        if ids:
            script_keys, args = ledger.ack_call(self, CONSUMER_GROUP, ids)
            self.scripts["ack"](keys=script_keys, args=args)

    def dead_letter(
        self, entry_id: str, fields: dict[bytes, bytes], reason: str, detail: str, drop: DropRecord
    ) -> None:
        """Move a whole entry to the dead-letter stream (with `reason`, a `DeadLetterReason`,
        and `detail`), record `drop`, and ack and delete it: one transaction."""
        self.dead_letter_groups(entry_id, [(DeadLetter(entry_id, reason, detail, fields), drop)])

    def dead_letter_groups(
        self,
        entry_id: str,
        letters: list[tuple[DeadLetter, DropRecord]],
        keep: list[PackedGroup] | None = None,
    ) -> None:
        """In one transaction: each letter into the dead-letter stream with its drop recorded,
        the groups of the entry to `keep` written again as a new entry (read later, counted
        once: `groups_put` is not touched), and the entry acked and deleted."""
        pipe = self.redis.pipeline(transaction=True)
        for letter, drop in letters:
            fields: dict[str | bytes, str | bytes] = {
                "reason": letter.reason,
                "detail": letter.detail,
                "entry_id": letter.entry_id,
                **{k: v for k, v in letter.fields.items() if k not in DEAD_LETTER_FIELDS},
            }
            pipe.xadd(
                self.dead_letter_key, fields, maxlen=self.config.dead_letter_len, approximate=True
            )
            self.record_drop(drop, client=pipe)
        # (the trainer's: a foreign entry's letter was never put, nor counted consumed)
        consumed = sum(drop.source in ledger.CONSUMERS for _letter, drop in letters)
        pipe.hincrby(self.counters_key, "groups_dead_lettered", consumed)
        if keep:
            script_keys = [self.samples_key, self.entry_groups_key]
            args = [encode_entry(keep), len(keep)]
            self.scripts["reput"](keys=script_keys, args=args, client=pipe)
        script_keys, args = ledger.ack_call(self, CONSUMER_GROUP, [entry_id])
        self.scripts["ack"](keys=script_keys, args=args, client=pipe)
        pipe.execute()

    def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The newest `count` dead letters, oldest first."""
        out = []
        for _id, f in reversed(self.redis.xrevrange(self.dead_letter_key, count=count)):
            own = {k: v for k, v in f.items() if k not in DEAD_LETTER_FIELDS}
            out.append(
                DeadLetter(
                    f[b"entry_id"].decode(), f[b"reason"].decode(), f[b"detail"].decode(), own
                )
            )
        return out

    # --- drops --------------------------------------------------------------------------------

    def record_drop(
        self, record: DropRecord, give_back: int | None = None, client: Any = None
    ) -> None:
        """Count the drop in groups and in samples and log it (one script, `ledger.drop_call`);
        with `give_back`, that prompt draw is drawn again first; queued on `client`, a
        pipeline, when given."""
        script_keys, args = ledger.drop_call(self, record, self.config.drop_log_len, give_back)
        self.scripts["drop"](keys=script_keys, args=args, client=client)

    def drop_counts(self, unit: str = "groups") -> dict[str, int]:
        """Drops by reason in `unit` ("groups" or "samples"); reasons at 0 are left out."""
        raw = {k.decode(): int(v) for k, v in self.redis.hgetall(self.drops_key).items()}
        groups, samples = ledger.split_drops(raw)
        return {"groups": groups, "samples": samples}[unit]

    def drop_log(self, count: int = 100) -> list[DropRecord]:
        return keys.drop_records(self.redis.xrevrange(self.drop_log_key, count=count))

    # --- versions -----------------------------------------------------------------------------

    def set_version(self, role: str, version: int) -> None:
        self.redis.set(self.version_prefix + role, version)

    def get_version(self, role: str, default: int = -1) -> int:
        return keys.version_of(self.redis.get(self.version_prefix + role), default)

    def forget_version(self, role: str) -> None:
        self.redis.delete(self.version_prefix + role)

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

    def start_group(self) -> int:
        """Draw the run's next prompt (one given back first, else the cursor's next) and count
        its group generated and in flight as `p{draw}`, in one script. Returns the draw."""
        script_keys, args = ledger.start_call(self)
        return int(self.scripts["start"](keys=script_keys, args=args))

    def recover_in_flight(self, source: str) -> int:
        """At a router's start: end the flight of the groups a killed one left (`ledger.py`)."""
        left = self.redis.hgetall(self.in_flight_key)
        for group_id, draw in left.items():
            self.record_drop(recovery.in_flight_drop(source, group_id), give_back=int(draw))
        recovery.say_recovered(len(left))
        return len(left)

    def record_trained(
        self, step: int, group_ids: list[str], consumed: int = 0, ack: list[str] | None = None
    ) -> Ledger:
        """The groups whose rollout made version `step` (and `groups_trained`), with the
        step's `consumed` groups counted first (unless the trainer counted them already) and
        the entries of `ack` acked (`ack`): one script, the trainer's step in one round trip.
        Then the ledger's balance after it is checked (a violation is counted in
        `ledger_violations` and said loudly)."""
        script_keys, args = ledger.step_call(
            self, CONSUMER_GROUP, step, group_ids, consumed, ack or []
        )
        after = ledger.step_reply(self.scripts["step"](keys=script_keys, args=args))
        if not after.balanced:
            after.violations = self.incr_counter("ledger_violations")
            ledger.say_unbalanced(after, "trainer")
        return after

    def rewind_trainer(self, groups_consumed: int, version: int) -> None:
        """A trainer resumed at `version` with `groups_consumed` from its checkpoint."""
        recovery.rewind_trainer(self.redis, self, groups_consumed, version)

    def ledger(self, details: bool = False) -> Ledger:
        """Where every group went, as of now (one MULTI); with `details`, also the newest drop
        detail of each reason (`ledger.with_details`)."""
        pipe = self.redis.pipeline(transaction=True)
        ledger.queue_read(self, pipe)
        reading = ledger.of_replies(*pipe.execute())
        if details:
            return ledger.with_details(reading, self.drop_log(ledger.DETAIL_RECORDS))
        return reading

    def trained(self) -> dict[int, list[str]]:
        """Group ids trained at each optimizer step of the newest weights' lineage."""
        return keys.trained_of(self.redis.hgetall(self.trained_key))

    def set_limits(self, limits: SampleLimits) -> None:
        """The longest sample the trainer of this run takes (its start writes it)."""
        self.redis.set(self.limits_key, msgspec.json.encode(limits))

    def release_lease_of(self, role: str, pid: int) -> None:
        """Give up the `role` lease of process `pid` of this host (a launcher whose child was
        killed: its successor then need not wait the lease out)."""
        holder = (self.redis.get(self.lease_prefix + role) or b"").decode()
        if holder.startswith(f"{role} pid {pid} on {socket.gethostname()},"):
            self.scripts["release"](keys=[self.lease_prefix + role], args=[holder])

    def set_status(self, status: ServiceStatus, ttl_s: float = 30.0) -> None:
        """Report what this service is doing; gone after `ttl_s` unless reported again."""
        key, value, ttl_ms = self.status_write(status, ttl_s)
        self.redis.set(key, value, px=ttl_ms)

    def statuses(self) -> dict[str, ServiceStatus]:
        """The last status of every service that reported one recently, by role."""
        names = sorted(self.redis.scan_iter(self.status_prefix + "*"))
        return keys.statuses_of(self.redis.mget(names) if names else [])

    def write_refused(self) -> str:
        """Why Redis refuses writes, with what to change (refusals.py: its disk full, ...); ""
        when a write goes through. Other errors raise."""
        try:
            self.redis.set(self.probe_key, 1, px=10_000)
        except redis.ResponseError as exc:
            if hint := refusal(exc):
                return f"{exc}: {hint}"
            raise
        return ""

    # --- metrics ------------------------------------------------------------------------------

    def publish_metrics(
        self, source: str, step: int, values: dict[str, float], once_per_step: bool = False
    ) -> bool:
        """Append a record; with `once_per_step`, only when `step` is above the last step of
        `source` written so (a step trained again after a resume is not written twice).
        Returns whether it was written."""
        entry = self.metrics_entry(source, step, values)
        if once_per_step:
            script_keys = [self.metrics_key, self.metrics_steps_key]
            args = [source, step, entry["d"], self.config.metrics_len]
            return bool(self.scripts["metrics_once"](keys=script_keys, args=args))
        self.redis.xadd(self.metrics_key, entry, maxlen=self.config.metrics_len, approximate=True)
        return True

    def last_metrics_id(self) -> str:
        """Id of the newest metrics record ("0" when there is none)."""
        return keys.newest_id(self.redis.xrevrange(self.metrics_key, count=1))

    def metrics_id_of(self, written: dict[str, Any] | None) -> str:
        """Where a reader whose files hold the records up to `written` (the newest as a row:
        its `source`, `step` and `time`; None: none) reads on: that record's id, found newest
        first, so records it failed to write (`tandem up` on a full disk) are read again on a
        resume; "0" when none was written; the stream's newest when `written` was trimmed."""
        if written is None:
            return "0"
        newest = (written.get("source"), written.get("step"), written.get("time"))
        end = "+"
        while entries := self.redis.xrevrange(self.metrics_key, max=end, count=1000):
            for raw_id, fields in entries:
                record = decode(fields[b"d"], MetricsRecord)
                if (record.source, record.step, record.time) == newest:
                    return keys.entry_id(raw_id)
            end = "(" + keys.entry_id(entries[-1][0])
        return self.last_metrics_id()

    def read_metrics(
        self, after_id: str = "0", block_ms: int | None = None, count: int | None = None
    ) -> list[tuple[str, MetricsRecord]]:
        """Records after `after_id` (exclusive), oldest first; at most `count` when given."""
        reply = self.redis.xread({self.metrics_key: after_id}, count=count, block=block_ms)
        return keys.stream_entries(reply, MetricsRecord)
