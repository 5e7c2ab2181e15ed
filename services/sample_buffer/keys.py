"""Key names, writes and reply decoding of one run's buffer: the part `SampleBuffer` (blocking,
for the trainer, the broker and `tandem up`) and `AsyncSampleBuffer` (asyncio, for the router)
share. Knows no connection: a write is queued on a pipeline of either client (redis-py's sync
and asyncio pipelines queue commands the same way), a read's reply is decoded here. The writes
the ledger counts (start, put, drop) are its Lua scripts (ledger.py), with their keys and
arguments from `ledger.*_call`.

The backlog: `groups_put - groups_consumed` (counters) is the number of groups produced and not
yet trained or dropped by the trainer; the router's producers wait while it is at
`--max-buffer-depth`. The stream's length is not used for it: with `--save` the trainer acks
only once a checkpoint holds the update, so the stream may hold groups already consumed.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any, TypeVar

import msgspec

from proto import DropRecord, MetricsRecord, decode, encode
from proto.contract import ContractMismatchError, RunContract, ServiceStatus, mismatch

T = TypeVar("T")

CONSUMER_GROUP = "trainer"


class BufferKeys:
    """The keys of run `run_id` (see buffer.py's module docstring for what each holds)."""

    def __init__(self, run_id: str) -> None:
        prefix = f"tandem:{run_id}:"
        self.samples_key = prefix + "samples"
        self.drops_key = prefix + "drops"
        self.drop_log_key = prefix + "drop_log"
        self.metrics_key = prefix + "metrics"
        self.version_prefix = prefix + "version:"
        self.contract_key = prefix + "contract"
        self.counters_key = prefix + "counters"
        self.status_prefix = prefix + "status:"
        self.trained_key = prefix + "trained"
        self.redraw_key = prefix + "redraw"
        self.dead_letter_key = prefix + "dead_letter"
        self.in_flight_key = prefix + "in_flight"
        self.open_sessions_key = prefix + "open_sessions"  # the router's: name -> samples held
        self.metrics_steps_key = prefix + "metrics_steps"
        self.trainer_drops_key = prefix + "trainer_drops"
        self.entry_groups_key = prefix + "entry_groups"
        self.limits_key = prefix + "limits"
        self.probe_key = prefix + "write_probe"  # a write that says Redis takes writes again
        self.mark_key = prefix + "store_mark"  # gone or replaced: the store lost the run
        self.lease_prefix = prefix + "lease:"  # + role: one router and one trainer per run
        # The lease that fences this client's ledger writes (ledger.FENCE) and its owner, set
        # by the service holding it; '' = none checked (tools, tests).
        self.lease_key = self.lease_prefix + "router"
        self.lease_owner = ""

    # --- writes, queued on a pipeline ---------------------------------------------------------

    def queue_contract(self, pipe: Any, mine: RunContract, who: str) -> None:
        """Each term of `mine` the run does not have yet (HSETNX), with who set it."""
        encoder = msgspec.json.Encoder()
        for term, value in mine.terms().items():
            pipe.hsetnx(self.contract_key, term, encoder.encode(value))
            pipe.hsetnx(self.contract_key, f"by:{term}", who)

    def status_write(self, status: ServiceStatus, ttl_s: float) -> tuple[str, bytes, int]:
        """(key, value, expiry in ms) of a status report."""
        if not status.updated_at:
            status.updated_at = time.time()
        return self.status_prefix + status.role, msgspec.json.encode(status), int(ttl_s * 1000)

    def queue_depth(self, pipe: Any) -> None:
        """Queue the reads of the depth (`depth_of` decodes their replies)."""
        pipe.xlen(self.samples_key)
        pipe.hvals(self.entry_groups_key)

    def metrics_entry(self, source: str, step: int, values: dict[str, float]) -> dict[str, bytes]:
        record = MetricsRecord(source=source, step=step, values=values, time=time.time())
        return {"d": encode(record)}


# Leases (one router, one trainer and one broker per run; ledger.LEASE): a service that stops
# renewing its lease keeps the run LEASE_TTL_S more, so a start waits LEASE_WAIT_S for a killed
# one's.
LEASE_TTL_S = 5.0
LEASE_RENEW_S = 1.0
LEASE_WAIT_S = LEASE_TTL_S + LEASE_RENEW_S


def lease_held(role: str, run_id: str, holder: str) -> str:
    """Why a start is refused: another `role` renews the run's lease."""
    return (
        f"another {role} holds run {run_id}: {holder} (it renews its lease in Redis every "
        f"{LEASE_RENEW_S:g} s). One {role} per run: stop that one, or give this one another "
        "--run-id"
    )


def lease_waiting(role: str, run_id: str, holder: str) -> str:
    return (
        f"waiting up to {LEASE_WAIT_S:g} s for run {run_id}'s {role} lease, held by {holder} "
        f"(one killed just now lets it go within {LEASE_TTL_S:g} s)"
    )


def lease_lost(role: str, run_id: str, holder: str) -> str:
    """Why a service stops: another took its run over while it did not renew its lease."""
    return (
        f"another {role} took run {run_id} over: {holder} (this one did not renew its lease "
        f"for {LEASE_TTL_S:g} s: stopped, or cut off from Redis); this one writes no more"
    )


def lease_owner_name(role: str) -> str:
    """How a lease names its holder: role, process, host, start time and a tag of its own."""
    started, tag = time.strftime("%H:%M:%S"), uuid.uuid4().hex[:8]
    return f"{role} pid {os.getpid()} on {socket.gethostname()}, started {started} [{tag}]"


# --- reply decoding ---------------------------------------------------------------------------


def entry_id(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def depth_of(entries: int, counts: list[bytes]) -> int:
    """Groups in the stream: one per entry, more for an entry noted in `entry_groups`."""
    return int(entries) + sum(int(n) - 1 for n in counts)


def int_hash(raw: dict[bytes, bytes]) -> dict[str, int]:
    """A hash of integers (`counters`, `drops`) as str -> int."""
    return {k.decode(): int(v) for k, v in raw.items()}


def version_of(raw: bytes | None, default: int) -> int:
    return int(raw) if raw is not None else default


def stream_entries(reply: Any, message_type: type[T]) -> list[tuple[str, T]]:
    """(id, record) of an XREAD/XREADGROUP reply; a pending entry deleted meanwhile (no
    fields) is skipped."""
    out = []
    for _stream, entries in reply or []:
        for raw_id, fields in entries:
            if fields:
                out.append((entry_id(raw_id), decode(fields[b"d"], message_type)))
    return out


def drop_records(entries: list[Any]) -> list[DropRecord]:
    """The records of an XREVRANGE reply of `drop_log`."""
    return [decode(fields[b"d"], DropRecord) for _id, fields in entries]


def newest_id(entries: list[Any]) -> str:
    """Id of the first entry of an XREVRANGE reply ("0" when empty)."""
    return entry_id(entries[0][0]) if entries else "0"


def contract_of(raw: dict[bytes, bytes]) -> RunContract:
    """The run's contract from the `contract` hash (terms nobody stated are None)."""
    run = {k.decode(): msgspec.json.decode(v) for k, v in raw.items() if not k.startswith(b"by:")}
    return msgspec.convert(run, RunContract)


def check_contract(mine: RunContract, raw: dict[bytes, bytes], who: str) -> RunContract:
    """The run's contract; `ContractMismatchError` (naming the flag) on the first term of
    `mine` it contradicts."""
    stored = {k.decode(): v.decode() for k, v in raw.items()}
    run = {k: msgspec.json.decode(v) for k, v in stored.items() if not k.startswith("by:")}
    for term, value in mine.terms().items():
        if run.get(term) != value:
            by = stored.get(f"by:{term}", "?")
            raise ContractMismatchError(mismatch(term, run.get(term), by, value, who))
    return msgspec.convert(run, RunContract)


def statuses_of(values: list[bytes | None]) -> dict[str, ServiceStatus]:
    out = {}
    for value in values:
        if value is not None:
            status = msgspec.json.decode(value, type=ServiceStatus)
            out[status.role] = status
    return out


def trained_of(raw: dict[bytes, bytes]) -> dict[int, list[str]]:
    return {
        int(k): msgspec.json.decode(v) for k, v in sorted(raw.items(), key=lambda kv: int(kv[0]))
    }


# --- the backlog rule -------------------------------------------------------------------------


def backlog(counters: dict[str, int]) -> int:
    """Groups put and not yet consumed by the trainer (never below 0: a trainer resumed on a
    fresh Redis may count more consumed than were put)."""
    return max(counters.get("groups_put", 0) - counters.get("groups_consumed", 0), 0)
