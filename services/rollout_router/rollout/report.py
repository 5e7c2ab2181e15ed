"""What the rollout loop reports: `rollout/*` metrics per batch of groups put, its drops (with
their reason, in groups and in samples), the loop's status (`GET /rollout/status`, with the
run's ledger) and its `ServiceStatus` record for `tandem up`'s watchdog. Reads a
`LoopSnapshot` the loop hands out, Redis and the worker pool; never holds the loop."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.exceptions import RedisError

from proto import DropReason, DropRecord, SampleGroup
from proto.contract import ServiceStatus
from proto.run_terms import RunTerms
from services.rollout_router.backpressure import room_sentence
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.config import RolloutConfig
from services.rollout_router.rollout.progress import engines_version, read_demand
from services.sample_buffer import AsyncSampleBuffer
from services.sample_buffer.ledger import Ledger

log = logging.getLogger("tandem.router.rollout")

SILENT_ENGINE_S = 60.0  # an engine holding requests this long without an answer is named
LOGGED_ONE_BY_ONE = 10  # drops of a reason logged each with its detail; later ones as counts
# What to change when every group is dropped for this reason (the status's note says it).
FIXES: dict[str, str] = {
    DropReason.ALL_REWARDS_EQUAL: "--dynamic-sampling drops a group whose samples all score the "
    "same: check the reward function on a few responses, or run without --dynamic-sampling",
}


class GroupDroppedError(Exception):
    """A group will not be trained on, for `reason`; `samples` dropped with it (None: all);
    `refused`: the engines refused its request (HTTP 4xx)."""

    def __init__(
        self, reason: DropReason, detail: str, samples: int | None = None, refused: bool = False
    ) -> None:
        super().__init__(detail)
        self.reason, self.samples, self.refused = reason, samples, refused


class RequestsRefusedError(RuntimeError):
    """The engines refused the requests of REFUSED_IN_A_ROW groups in a row."""


@dataclass(frozen=True)
class LoopSnapshot:
    """What the rollout loop shows its observers at one moment (`RolloutLoop.snapshot`)."""

    state: str
    waiting_for: str
    since: float  # (time.time() the state was entered)
    error: str
    paused: bool
    run: RunTerms  # the run's terms
    rollout: RolloutConfig  # the settings in force
    groups_in_flight: int
    requests_in_flight: int
    groups_put: int  # by this router
    samples_per_s: float  # over the last batch
    max_depth: int  # the buffer depth bound (0: none)
    producers_waiting: int  # for room under it
    busy: str  # where the groups in flight are ("" when none is)
    note: str  # the groups dropped since the last one put
    last_eval: dict[str, float]
    last_eval_version: int


class InFlightWork(Protocol):
    """What `busy` reads of the rollout loop."""

    gen: Any  # .in_flight: /generate requests
    pool: WorkerPool
    episodes: Any  # EpisodeRunner | None
    reward: Any  # Reward
    groups: Any  # (sized) groups in flight


def refused(exc: Exception) -> bool:
    """An engine's answer that the request is at fault (4xx but a timeout or a rate limit)."""
    status = getattr(exc, "status", 0)
    return 400 <= status < 500 and status not in (408, 429)


class Drops:
    """The router's drops: logged (the first `LOGGED_ONE_BY_ONE` of each reason one by one,
    then the count at 100, 1,000, ...: a run dropping every group does not flood its log; the
    drop log and the ledger in Redis keep every one), and those since the last group put, for
    the status (`note`: why no group is put)."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.since_put: Counter[str] = Counter()
        self.last = ""

    def log(self, what: str, group_id: str, reason: str, detail: str) -> None:
        self.seen[reason] += 1
        count = self.seen[reason]
        if count <= LOGGED_ONE_BY_ONE:
            log.warning("dropping %s %s: %s (%s)", what, group_id, reason, detail[:300])
            if count == LOGGED_ONE_BY_ONE:
                log.warning(
                    f"later {reason} drops are logged as counts (every one is in the run's drop "
                    "log and ledger: tandem ledger)"
                )
        elif math.log10(count).is_integer():
            log.warning("%d drops of %s so far (the last: %s)", count, reason, detail[:300])

    def group_dropped(self, reason: str, detail: str) -> None:
        self.since_put[reason] += 1
        self.last = detail

    def group_put(self) -> None:
        self.since_put.clear()

    def note(self) -> str:
        """The groups dropped since the last one put, by reason, and the last one's detail
        (empty once a group is put)."""
        if not self.since_put:
            return ""
        reasons = ", ".join(f"{r} {n}" for r, n in self.since_put.most_common())
        total = sum(self.since_put.values())
        note = f"{total} groups dropped since the last one put ({reasons}; the last: {self.last[:200]})"
        fix = FIXES.get(self.since_put.most_common(1)[0][0], "")
        return f"{note}: {fix}" if fix else note


@dataclass
class BatchStats:
    """Groups put since the last `rollout/*` metrics (one report per rollout_batch_size)."""

    kept: int = 0
    finished: int = 0  # put or dropped
    samples: int = 0
    reward_sum: float = 0.0
    length_sum: int = 0
    cut: int = 0  # samples that ended at the length bound (finish "length")
    rewards: int = 0  # samples scored (of groups put or dropped)
    reward_failed: int = 0  # of them, whose reward failed (raised, None, NaN, timed out)
    reward_timed_out: int = 0  # of those, past --rm-timeout-s
    min_version: int | None = None
    started: float = field(default_factory=time.monotonic)

    def add(self, group: SampleGroup, batch_size: int) -> bool:
        """Count a put group; True once `batch_size` groups are counted (time to publish)."""
        self.kept += 1
        self.finished += 1
        self.samples += len(group.samples)
        self.reward_sum += sum(s.reward for s in group.samples)
        self.length_sum += sum(len(s.response_ids) for s in group.samples)
        self.cut += sum(s.finish_reason == "length" for s in group.samples)
        v = group.weight_version
        self.min_version = v if self.min_version is None else min(self.min_version, v)
        return self.kept >= batch_size

    async def publish(self, buffer: AsyncSampleBuffer, batch: int, engines: int) -> float:
        """Publish the batch's `rollout/*` metrics; its samples per second.
        `rollout/batch` is the index of the run's batch just completed (groups put // B - 1);
        `rollout/groups_dropped` the groups dropped by the router since the last report;
        `rollout/reward_failed_fraction` (and `_timeout_fraction`) the share of the samples
        scored since the last report whose reward failed (timed out), `rollout/reward_failures`
        their count; `drops/{reason}/groups|samples` and `ledger/*` the run's totals so far."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        samples_per_s = self.samples / elapsed
        ledger = await buffer.ledger()
        values = {
            "rollout/batch": float(max(ledger.put // batch - 1, 0)),
            "rollout/reward_mean": self.reward_sum / self.samples,
            "rollout/samples_per_s": samples_per_s,
            "rollout/response_len_mean": self.length_sum / self.samples,
            "rollout/truncated_fraction": self.cut / self.samples,
            "rollout/groups": float(self.kept),
            "rollout/prompts_generated": float(self.finished),
            "rollout/groups_dropped": float(self.finished - self.kept),
            "rollout/batch_time_s": elapsed,
            "rollout/engines_version": float(engines),
            "rollout/reward_failures": float(self.reward_failed),
            "rollout/reward_failed_fraction": self.reward_failed / max(self.rewards, 1),
            "rollout/reward_timeout_fraction": self.reward_timed_out / max(self.rewards, 1),
            **ledger_metrics(ledger),
        }
        step = self.min_version if self.min_version is not None else 0
        await buffer.publish_metrics("router", step, values)
        return samples_per_s


async def record_drop(
    buffer: AsyncSampleBuffer,
    drops: Drops,
    group_id: str,
    reason: DropReason,
    detail: str,
    samples: int,
    groups: int = 1,
    give_back: int | None = None,
    quiet: bool = False,
) -> None:
    """Record a router drop: a whole group (`groups` 1, with its `samples`), or
    `samples` of a group that is still put (`groups` 0). `give_back`: draw that prompt again.
    `quiet` (a cancelled group): not logged, nor counted as a reason no group is put."""
    if not quiet:
        drops.log("group" if groups else f"{samples} sample(s) of", group_id, reason, detail)
        if groups:
            drops.group_dropped(reason, detail)
    record = DropRecord(
        source="router",
        reason=reason,
        count=groups,
        samples=samples,
        group_id=group_id,
        detail=detail[:500],
    )
    await buffer.record_drop(record, give_back=give_back)


def ledger_metrics(ledger: Ledger) -> dict[str, float]:
    """The run's ledger as metric paths (every drop reason in both units)."""
    out = {
        f"ledger/{name}": float(getattr(ledger, name))
        for name in ("generated", "put", "trained", "dropped", "buffered", "in_flight")
    }
    for unit, counts in (("groups", ledger.dropped_groups), ("samples", ledger.dropped_samples)):
        out.update({f"drops/{reason}/{unit}": float(n) for reason, n in counts.items()})
    return out


def busy(loop: InFlightWork) -> str:
    """Where the groups in flight are: at the engines, the environment, the reward (a run that
    makes no progress while its loop waits for nothing says which one holds it)."""
    parts = [f"{loop.gen.in_flight} requests at the engines"]
    workers = loop.pool.workers.values()
    if silent := [(w, s) for w in workers if (s := w.silent_s()) >= SILENT_ENGINE_S]:
        named = ", ".join(f"{w.url} none of its {w.outstanding} for {s:.0f} s" for w, s in silent)
        parts.append(
            f"answered: {named} (long responses, or paused by POST /pause_generation there: "
            "POST /continue_generation resumes it)"
        )
    if loop.episodes is not None and (env := loop.episodes.client.calls.describe()):
        parts.append(env)
    if calls := loop.reward.activity():
        parts.append(calls)
    return f"{len(loop.groups)} groups in flight: {'; '.join(parts)}"


async def service_status(
    look: Callable[[], LoopSnapshot], buffer: AsyncSampleBuffer, pool: WorkerPool, error: str = ""
) -> ServiceStatus:
    """The status record; `failed` with `error` when a task died. The loop is looked at again
    after the reads from Redis: a change meanwhile (a stop) is what the record says."""
    snap, numbers = look(), {}
    with contextlib.suppress(RedisError):
        engines = await engines_version(buffer, pool)
        demand = await read_demand(buffer, snap.run, snap.groups_in_flight, engines)
        numbers = dict(
            groups_put=demand.put,
            groups_consumed=demand.consumed,
            trainer_version=demand.trainer_version,
            engines_version=demand.engines_version,
        )
    snap = look()
    detail: dict[str, float | int | str] = {
        "groups_put_here": snap.groups_put,
        "groups_in_flight": snap.groups_in_flight,
        "requests_in_flight": snap.requests_in_flight,
    }
    if snap.note:
        detail["note"] = snap.note
    if snap.busy:
        detail["busy"] = snap.busy
    detail.update(numbers)
    return ServiceStatus(
        role="router",
        state="failed" if error else snap.state,
        waiting_for="" if error else snap.waiting_for,
        since=snap.since,
        error=error or snap.error,
        detail=detail,
        pid=os.getpid(),
    )


async def status(snap: LoopSnapshot, buffer: AsyncSampleBuffer, pool: WorkerPool) -> dict[str, Any]:
    """The loop's state; the Redis-backed fields are None while Redis is unavailable.
    `drops` is in groups by reason; `ledger` says where every group of the run went.
    `buffer_depth` is the backlog the depth bound counts (groups put, not yet consumed);
    `waiting` says when producers wait for it ("buffer full (depth N of M)"); `note` the groups
    dropped since the last one put, by reason ("" once one is put); `busy` where the groups in
    flight are."""
    names = "engines_version trainer_version buffer_depth drops batch groups_consumed ledger"
    redis_fields: dict[str, Any] = dict.fromkeys(names.split())
    redis_fields["waiting"] = ""
    with contextlib.suppress(RedisError):
        ledger = await buffer.ledger()
        depth = max(ledger.buffered, 0)  # keys.backlog
        redis_fields = {
            "engines_version": await engines_version(buffer, pool),
            "trainer_version": await buffer.get_version("trainer"),
            "buffer_depth": depth,
            "waiting": room_sentence(depth, snap.max_depth),
            "drops": ledger.dropped_groups,
            "batch": ledger.put // snap.run.rollout_batch_size,
            "groups_consumed": ledger.consumed,
            "ledger": ledger.as_dict(),
        }
    return {
        "state": snap.state,
        "waiting_for": snap.waiting_for,
        "busy": snap.busy,
        "note": snap.note,
        "paused": snap.paused,
        "error": snap.error,
        "in_flight": snap.requests_in_flight,
        "groups_in_flight": snap.groups_in_flight,
        "samples_per_s": snap.samples_per_s,
        "groups_put": snap.groups_put,
        "max_buffer_depth": snap.max_depth,
        "producers_waiting": snap.producers_waiting,
        "last_eval_version": snap.last_eval_version,
        "last_eval": snap.last_eval,
        **redis_fields,
    }
