"""What a run needs of its Redis, checked as each service joins the run (`Membership.join`), and
the run's mark in it, by which a member finds that the store lost the run's state.

Needs: keys never evicted (`maxmemory-policy noeviction`, or no `maxmemory`: an evicting Redis
dropped the ledger's and the trained record's keys while the run went on, and groups were
trained twice) and Lua scripts (the ledger's writes are scripts): refused, naming the setting.
A Redis without persistence (no AOF, no RDB saves) is the user's to choose: said, not refused.
A Redis that refuses CONFIG (some managed ones) is said too: its settings cannot be checked.
`memory_note` says a Redis near its maxmemory (at it, writes are refused: OOM), for the watchdog.

Mark (`BufferKeys.mark_key`): written once per run (SET NX) by the first member to join and read
back by each. A member that finds it gone or another one (Redis restarted empty, flushed, or
evicted it) stops the run: what the store counted (samples, ledger, prompt order, trained
groups) went with it, and a run that went on would train groups twice. So does a member that
finds a counter that only grows below what it read before (a store rolled back with its mark: an
older snapshot restored, a failover to a replica behind it, the counters edited).
"""

from __future__ import annotations

import uuid

import redis
from redis.exceptions import ResponseError

NEEDS = "its maxmemory-policy is noeviction and its persistence what this run needs"


def store_problems(client: redis.Redis) -> tuple[str, list[str]]:
    """(a refusal naming the Redis setting to change, '' when none; warnings to say)."""
    config, warnings = {}, []
    try:
        config = client.config_get()  # (every setting: one call, on any Redis version)
    except ResponseError as exc:
        warnings.append(f"cannot read the Redis settings ({exc}): make sure {NEEDS}")
    policy, limit = config.get("maxmemory-policy", "noeviction"), config.get("maxmemory", "0")
    if limit != "0" and policy != "noeviction":
        return (
            f"the Redis at --redis-url evicts keys at its memory limit (maxmemory-policy "
            f"{policy}, maxmemory {limit}): it would drop this run's ledger and samples while "
            "the run goes on; set maxmemory-policy noeviction (or maxmemory 0) on it"
        ), warnings
    try:
        client.eval("return 1", 0)
    except ResponseError as exc:
        return f"the Redis at --redis-url refuses Lua scripts ({exc}): allow EVAL on it", warnings
    if config.get("appendonly") == "no" and not config.get("save"):
        warnings.append(
            "the Redis at --redis-url keeps this run in memory only (appendonly no, save ''): "
            "should it restart, the run stops, its state lost; appendonly yes keeps it"
        )
    return "", warnings


def memory_note(client: redis.Redis) -> str:
    """A Redis at 90% or more of its maxmemory, said with what to change; '' otherwise."""
    memory = client.info("memory")
    used, limit = memory.get("used_memory", 0), memory.get("maxmemory", 0)
    if not limit or used < 0.9 * limit:
        return ""
    return (
        f"uses {used / 2**20:.1f} MiB of its maxmemory {limit / 2**20:.1f} MiB (at it, every "
        "write is refused: OOM); raise maxmemory, or lower the router's --max-buffer-depth"
    )


def claim_mark(client: redis.Redis, key: str) -> bytes:
    """The run's mark in the store: set now by the first member, else the one it holds."""
    client.set(key, uuid.uuid4().hex, nx=True)
    return client.get(key) or b""


def store_lost(url: str, key: str, why: str = "") -> str:
    """Why a member stops when the run's mark is gone or changed (or `why`: its counters went
    back, membership.py)."""
    keep = "appendonly yes on that Redis keeps a restart from losing it"
    if not why:
        why = f"{key} is gone or replaced: Redis restarted without persistence, or its keys were "
        why += "evicted or deleted"
    else:
        keep = "a store restored or failed over must hold the run's newest writes"
    return (
        f"the Redis at {url} lost this run's state ({why}); the samples, the ledger, "
        "the prompt order and the record of trained groups went with it, so the run stops "
        "rather than train groups twice. `tandem up --resume` (or each service restarted with "
        f"the trainer's --load) goes on from the last checkpoint with a new ledger; {keep}"
    )
