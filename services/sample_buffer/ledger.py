"""The run's ledger: where every generated group went, counted in Redis as it happens.

Fates, in groups (hash `counters` unless said otherwise):
- `groups_generated`  the router drew a prompt and started its group (`start_group`); a group
                      that was never started this way (an agent session's) counts when it is
                      put or dropped.
- `in_flight`         hash group id -> prompt draw: started, neither put nor dropped yet.
- `groups_put`        put into the stream; `groups_consumed` taken off it by the trainer
                      (trained or dropped); buffered = put - consumed.
- `groups_trained`    trained (grows with the `trained` hash, rewound with it on a resume).
- `drops`             hash `{reason}:groups` and `{reason}:samples`; dropped = the sum of the
                      `:groups` fields. A drop recorded by the trainer is of a put group
                      (it must also be counted consumed; `trainer_drops` notes it with the
                      trainer's version, for `rewind_trainer`); any other drop of a whole
                      group ends that group's flight.
Balance: generated == trained + dropped + buffered + in_flight. Each event changes its counters
in one Lua script or MULTI, so a reading (one MULTI) never sees half an event of the router;
the trainer's own steps are sequential, so its check after a step is exact.

A router that dies leaves its groups in `in_flight`; the next router start drops them as
`cancelled` and gives their prompts back (recovery.py, `recover_in_flight`): one router per
run id, which its lease in Redis ensures (rollout_router/lease.py; `FENCE`). Its open agent sessions, and
the groups waiting for more of them, are noted in hash `open_sessions` while open; the next
router drops those left there as `cancelled` too (`recover_open`), as a stop would have.

The scripts' keys and arguments come from `start_call`, `put_call` and `drop_call`, so the
blocking `SampleBuffer` and the router's `AsyncSampleBuffer` run the same writes (either may
queue a script on a pipeline). One PUT writes a batch of groups: the router's group commit is
one script call, as atomic as a transaction and without its per-command round of replies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from proto import DropRecord, SampleGroup, encode
from proto.packed import PackedGroup, encode_entry, entry_of, group_key, pack
from services.sample_buffer.keys import BufferKeys, entry_id

Call = tuple[list[str], list[Any]]  # a script's keys and arguments

log = logging.getLogger("tandem.ledger")

# A PUT writes its groups into entries of at most ENTRY_GROUPS groups and ENTRY_BYTES bytes
# encoded (but an entry of one group): one XADD, one read and one ack carry many groups
# (bench/buffer_throughput.py), and an entry stays small enough to copy at once.
ENTRY_GROUPS = 64
ENTRY_BYTES = 1 << 20

# `tandem ledger` says why for each drop reason: the newest detail among the drop log's last
# DETAIL_RECORDS records (a reason older than those shows its counts only), cut to DETAIL_CHARS.
DETAIL_RECORDS, DETAIL_CHARS = 2000, 240

# Sources whose drops are of groups already put (and counted consumed by that source).
CONSUMERS = frozenset({"trainer"})

# Leases: one router, one trainer and one broker per run (membership.py). A
# lease is a key holding its owner, taken when free or renewed by its owner, with an expiry.
LEASE = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return held end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# The ledger's writes of a service that holds a lease (START, PUT, DROP, STEP) end with its
# lease key and its owner name ('' = none checked: tools, tests): one whose lease another holds
# writes nothing (it was stopped past its lease, and the other took its work over).
FENCED = "FENCED the lease of this writer is held by another: "
FENCE = f"""
local owner = ARGV[#ARGV]
if owner ~= '' then
  local held = redis.call('GET', KEYS[#KEYS])
  if held and held ~= owner then
    return redis.error_reply('{FENCED}' .. held)
  end
end
"""


def fenced_by(exc: BaseException | None) -> str:
    """Who holds the lease that refused a write (FENCE); '' for any other error."""
    text = str(exc)
    return text.removeprefix(FENCED) if text.startswith(FENCED) else ""


START = (
    FENCE
    + """
local given = redis.call('ZPOPMIN', KEYS[1])
local p
if given[1] then p = tonumber(given[2])
else p = redis.call('HINCRBY', KEYS[2], 'prompts_drawn', 1) - 1 end
redis.call('HINCRBY', KEYS[2], 'groups_generated', 1)
redis.call('HSET', KEYS[3], ARGV[1] .. p, p)
return p
"""
)

# KEYS: samples, counters, in_flight, entry_groups. ARGV: e (entries), e payloads, e group
# counts, then every group id as one msgpack array (a batch of groups, one script call: the
# router's group commit; one argument, not one a group: each costs the client ~1 µs).
# Each entry holds several groups (proto/packed.py) and their count as field `n`, the mark of an
# entry this ledger wrote (one without it was written outside the router's path: the trainer
# drops it as foreign, and never counts it consumed, since no PUT counted it put);
# `entry_groups` notes the count of an entry of more than one (the buffer's depth, `ACK`).
# Returns the entries' stream ids, in order, then the backlog after the put (groups_put - groups_consumed: the router's room, read
# without a round trip of its own).
# The counts are written once per batch, after its XADDs (a group id written twice in a batch
# ends one flight and counts the other generated, as one call per group would). Only a script's
# first write can fail on a full server (later ones are let through to keep it atomic), so a
# call leaves its whole batch counted or nothing.
PUT = (
    FENCE
    + """
local e = tonumber(ARGV[1])
local ids = {}
for i = 1, e do
  ids[i] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[1 + i], 'n', ARGV[1 + e + i])
  if ARGV[1 + e + i] ~= '1' then redis.call('HSET', KEYS[4], ids[i], ARGV[1 + e + i]) end
end
local names = cmsgpack.unpack(ARGV[2 + 2 * e])
redis.call('HINCRBY', KEYS[2], 'groups_put', #names)
local ended = 0
for i = 1, #names, 1000 do -- unpack's bound: a few thousand values
  ended = ended + redis.call('HDEL', KEYS[3], unpack(names, i, math.min(i + 999, #names)))
end
if ended < #names then redis.call('HINCRBY', KEYS[2], 'groups_generated', #names - ended) end
local c = redis.call('HMGET', KEYS[2], 'groups_put', 'groups_consumed')
ids[#ids + 1] = (tonumber(c[1]) or 0) - (tonumber(c[2]) or 0)
return ids
"""
)

# KEYS: samples, entry_groups. ARGV: payload, its number of groups. An entry of groups already
# put and counted (the good neighbours of a dead-lettered group), written again; its id.
REPUT = """
local id = redis.call('XADD', KEYS[1], '*', 'd', ARGV[1], 'n', ARGV[2])
if ARGV[2] ~= '1' then redis.call('HSET', KEYS[2], id, ARGV[2]) end
return id
"""

# KEYS[1..2]: samples, entry_groups; ARGV[1] the consumer group, ARGV[first..] entry ids. Acks and
# deletes each entry and forgets its group count.
_ACK_LOOP = """
for i = {first}, {last} do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  if redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then redis.call('HDEL', KEYS[2], ARGV[i]) end
end
"""
ACK = _ACK_LOOP.format(first=2, last="#ARGV") + "return #ARGV - 1\n"

# KEYS: samples, entry_groups, counters, trained, drops, in_flight, lease. ARGV: consumer group,
# step, its groups' ids (JSON), how many, groups consumed, entry ids to ack, owner. A step in
# one call, not four round trips: the rollout's groups counted consumed, the lineage of version
# `step` (replacing one written before a resume), the acks of entries done with, and the
# ledger's reads after it (`step_reply`).
STEP = (
    FENCE
    + """
if ARGV[5] ~= '0' then redis.call('HINCRBY', KEYS[3], 'groups_consumed', ARGV[5]) end
redis.call('HSET', KEYS[4], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[3], 'groups_trained', ARGV[4])
"""
    + _ACK_LOOP.format(first=6, last="#ARGV - 1")
    + "return {redis.call('HGETALL', KEYS[3]), redis.call('HGETALL', KEYS[5]), "
    + "redis.call('HLEN', KEYS[6])}\n"
)

# KEYS: drops, drop_log, counters, in_flight, redraw, version:trainer, trainer_drops.
# ARGV: reason, groups, samples, record, drop_log_len, group id, by a consumer (1/0), draw to
# give back ('' = none). A consumer's drop of a named group is also noted with the trainer's
# version, so that a resume to an older checkpoint can take it back (`rewind_trainer`), but for a
# dead letter: that entry left the stream for good and is never consumed again.
DROP = (
    FENCE
    + """
local groups, samples = tonumber(ARGV[2]), tonumber(ARGV[3])
if groups ~= 0 then redis.call('HINCRBY', KEYS[1], ARGV[1] .. ':groups', groups) end
if samples ~= 0 then redis.call('HINCRBY', KEYS[1], ARGV[1] .. ':samples', samples) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'd', ARGV[4])
if ARGV[7] == '1' and ARGV[6] ~= '' and ARGV[1] ~= 'dead_lettered' then
  local v = redis.call('GET', KEYS[6]) or '-1'
  redis.call('HSET', KEYS[7], ARGV[6], v .. ' ' .. ARGV[1] .. ' ' .. groups .. ' ' .. samples)
elseif ARGV[7] == '1' then
  -- a consumer's drop of a put group: its flight ended at the put
elseif groups > 0 then
  local ended = redis.call('HDEL', KEYS[4], ARGV[6])
  if groups > ended then redis.call('HINCRBY', KEYS[3], 'groups_generated', groups - ended) end
end
if ARGV[8] ~= '' then redis.call('ZADD', KEYS[5], tonumber(ARGV[8]), ARGV[8]) end
return 1
"""
)

# ARGV: source, step, record, metrics_len. Refuses a step not above the source's last one.
METRICS_ONCE = """
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '-1')
if tonumber(ARGV[2]) <= last then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'd', ARGV[3])
return 1
"""


@dataclass
class Ledger:
    """One consistent reading of the fates, in groups (drops also in samples, by reason)."""

    generated: int = 0
    put: int = 0
    consumed: int = 0
    trained: int = 0
    dropped: int = 0
    in_flight: int = 0
    buffered: int = 0
    violations: int = 0
    dropped_groups: dict[str, int] = field(default_factory=dict)
    dropped_samples: dict[str, int] = field(default_factory=dict)
    # reason -> the newest drop record's detail (of the drop log's last `DETAIL_RECORDS`):
    # why, in the words of whoever dropped it; filled by `with_details`, empty otherwise
    last_detail: dict[str, str] = field(default_factory=dict)

    @property
    def difference(self) -> int:
        """generated - (trained + dropped + buffered + in flight); 0 when balanced."""
        return self.generated - (self.trained + self.dropped + self.buffered + self.in_flight)

    @property
    def balanced(self) -> bool:
        return self.difference == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "difference": self.difference, "balanced": self.balanced}

    def sentence(self) -> str:
        return (
            f"generated {self.generated} = trained {self.trained} + dropped {self.dropped} + "
            f"buffered {self.buffered} + in flight {self.in_flight}"
            + ("" if self.balanced else f" is off by {self.difference}")
        )

    def table(self) -> str:
        """The fates and the drops by reason, as lines for a terminal."""
        rows: list[tuple[str, int | str, str]] = [
            ("generated", self.generated, ""),
            ("put", self.put, ""),
            ("consumed", self.consumed, ""),
            ("trained", self.trained, ""),
            ("buffered", self.buffered, "put - consumed"),
            ("in flight", self.in_flight, ""),
            ("dropped", self.dropped, "groups"),
        ]
        for reason in sorted(set(self.dropped_groups) | set(self.dropped_samples)):
            groups, samples = (
                self.dropped_groups.get(reason, 0),
                self.dropped_samples.get(reason, 0),
            )
            # (samples dropped alone, from groups put and trained, count in samples only)
            note = f"groups dropped whole; {samples} samples dropped in all (alone or with them)"
            rows.append((f"  {reason}", groups, note))
            if detail := self.last_detail.get(reason):
                rows.append(("", "", f"  the last: {detail[:DETAIL_CHARS]}"))
        if self.violations:
            rows.append(("violations", self.violations, "trainer checks that did not balance"))
        lines = [f"{name:<22}{count:>10}  {note}".rstrip() for name, count, note in rows]
        verdict = "balanced" if self.balanced else f"UNBALANCED: difference {self.difference}"
        lines.append(f"{self.sentence()}: {verdict}")
        return "\n".join(lines)


def queue_read(keys: BufferKeys, pipe: Any) -> None:
    """Queue the ledger's reads on a transaction (one instant); `of_replies` decodes them."""
    pipe.hgetall(keys.counters_key)
    pipe.hgetall(keys.drops_key)
    pipe.hlen(keys.in_flight_key)


def of_replies(
    raw_counters: dict[bytes, bytes], raw_drops: dict[bytes, bytes], in_flight: int
) -> Ledger:
    counters = {k.decode(): int(v) for k, v in raw_counters.items()}
    groups, samples = split_drops({k.decode(): int(v) for k, v in raw_drops.items()})
    put, consumed = counters.get("groups_put", 0), counters.get("groups_consumed", 0)
    return Ledger(
        generated=counters.get("groups_generated", 0),
        put=put,
        consumed=consumed,
        trained=counters.get("groups_trained", 0),
        dropped=sum(groups.values()),
        in_flight=int(in_flight),
        buffered=put - consumed,
        violations=counters.get("ledger_violations", 0),
        dropped_groups=groups,
        dropped_samples=samples,
    )


def with_details(ledger: Ledger, drop_log: list[DropRecord]) -> Ledger:
    """`ledger` with the newest detail of each drop reason from `drop_log`, newest first (read
    `DETAIL_RECORDS` records: for `tandem ledger` and the run's ledger.json, not every check)."""
    for record in drop_log:
        if record.detail:
            ledger.last_detail.setdefault(record.reason, record.detail)
    return ledger


def split_drops(raw: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The drops hash as (groups by reason, samples by reason), zero counts left out."""
    out: dict[str, dict[str, int]] = {"groups": {}, "samples": {}}
    for key, value in raw.items():
        reason, _, unit = key.rpartition(":")
        if unit in out and value:
            out[unit][reason] = value
    return out["groups"], out["samples"]


def say_unbalanced(ledger: Ledger, who: str) -> None:
    """Say loudly that `ledger` (counted in `ledger.violations` already) does not balance."""
    log.error(
        "LEDGER UNBALANCED (%s check #%d): %s; drops by reason %s",
        who,
        ledger.violations,
        ledger.sentence(),
        ledger.dropped_groups,
    )
    print(f"[{who}] LEDGER UNBALANCED: {ledger.sentence()}", flush=True)


def start_call(keys: BufferKeys) -> Call:
    """START: draw the next prompt, count its group generated and in flight as `p{draw}`."""
    return [keys.redraw_key, keys.counters_key, keys.in_flight_key, keys.lease_key], [
        "p",
        keys.lease_owner,
    ]


def entries_of(groups: list[PackedGroup]) -> list[tuple[bytes, int]]:
    """`groups` cut into stream entries, in order, each as (payload, number of groups): at most
    ENTRY_GROUPS groups each, an entry encoded over ENTRY_BYTES cut in halves until it fits or
    holds one group (encoded once in the common case: sizing each group first cost more)."""
    out: list[tuple[bytes, int]] = []
    todo = [groups[i : i + ENTRY_GROUPS] for i in range(0, len(groups), ENTRY_GROUPS)][::-1]
    while todo:
        entry = todo.pop()
        payload = encode_entry(entry)
        if len(payload) > ENTRY_BYTES and len(entry) > 1:
            half = len(entry) // 2
            todo += [entry[half:], entry[:half]]
        else:
            out.append((payload, len(entry)))
    return out


def put_call(keys: BufferKeys, groups: list[SampleGroup | PackedGroup]) -> tuple[Call, list[int]]:
    """PUT of a batch: its entries' XADDs, the end of each group's flight, and `groups_put`;
    and the number of groups of each entry. ValueError (naming the group and field) when a
    group does not pack (`proto.packed.pack`)."""
    entries = entries_of([pack(group) for group in groups])
    counts = [count for _, count in entries]
    args: list[Any] = [len(entries), *(payload for payload, _ in entries), *counts]
    args.append(msgspec.msgpack.encode([group.group_id for group in groups]))
    args.append(keys.lease_owner)
    script_keys = [keys.samples_key, keys.counters_key, keys.in_flight_key, keys.entry_groups_key]
    return ([*script_keys, keys.lease_key], args), counts


def put_reply(reply: list[Any], counts: list[int]) -> tuple[list[str], int]:
    """A PUT's reply: the key of each group it wrote, and the backlog after it (>= 0)."""
    *ids, backlog = reply
    return group_keys([entry_id(raw) for raw in ids], counts), max(int(backlog), 0)


def group_keys(entry_ids: list[str], counts: list[int]) -> list[str]:
    """The key of each group written by one PUT: `{entry id}/{index in the entry}`."""
    return [group_key(e, i) for e, n in zip(entry_ids, counts, strict=True) for i in range(n)]


def ack_call(keys: BufferKeys, group: str, ids: list[str]) -> Call:
    """ACK of entries, given their ids or their groups' keys (`entry/index`)."""
    return [keys.samples_key, keys.entry_groups_key], [group, *_entries(ids)]


def _entries(ids: list[str]) -> list[str]:
    return list(dict.fromkeys(entry_of(i) for i in ids))


def step_call(
    keys: BufferKeys, group: str, step: int, group_ids: list[str], consumed: int, ack: list[str]
) -> Call:
    """STEP: `consumed` counted, `group_ids` as version `step`'s lineage, the entries of `ack`
    (ids or group keys) acked."""
    script_keys = [keys.samples_key, keys.entry_groups_key, keys.counters_key, keys.trained_key]
    script_keys += [keys.drops_key, keys.in_flight_key, keys.lease_key]
    trained = msgspec.json.encode(group_ids)
    args = [group, step, trained, len(group_ids), consumed, *_entries(ack), keys.lease_owner]
    return script_keys, args


def step_reply(reply: list[Any]) -> Ledger:
    """The ledger after a STEP, from its reads (each hash as a flat list of fields and values)."""
    counters, drops, in_flight = reply
    return of_replies(_hash(counters), _hash(drops), in_flight)


def _hash(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def drop_call(
    keys: BufferKeys, record: DropRecord, drop_log_len: int, give_back: int | None = None
) -> Call:
    """DROP: `record` in its units, logged, its group's flight ended (see the module
    docstring); with `give_back`, that prompt draw is drawn again first."""
    if not record.created_at:
        record.created_at = time.time()
    return [
        keys.drops_key,
        keys.drop_log_key,
        keys.counters_key,
        keys.in_flight_key,
        keys.redraw_key,
        keys.version_prefix + "trainer",
        keys.trainer_drops_key,
        keys.lease_key,
    ], [
        str(record.reason),
        record.count,
        record.samples,
        encode(record),
        drop_log_len,
        record.group_id,
        int(record.source in CONSUMERS),
        "" if give_back is None else give_back,
        keys.lease_owner,
    ]
