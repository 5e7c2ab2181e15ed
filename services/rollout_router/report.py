"""What the rollout loop reports: `rollout/*` metrics per batch of groups put, the loop's
status (`GET /rollout/status`) and its `ServiceStatus` record for `tandem up`'s watchdog.
Reads the loop's fields and Redis; changes nothing in the loop."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from proto import SampleGroup
from proto.contract import ServiceStatus
from services.sample_buffer.keys import backlog

if TYPE_CHECKING:
    from services.rollout_router.rollout import RolloutLoop


@dataclass
class BatchStats:
    """Groups put since the last `rollout/*` metrics (one report per rollout_batch_size)."""

    kept: int = 0
    finished: int = 0  # put or dropped
    samples: int = 0
    reward_sum: float = 0.0
    length_sum: int = 0
    min_version: int | None = None
    started: float = field(default_factory=time.monotonic)

    async def add(self, group: SampleGroup, loop: RolloutLoop) -> None:
        """Count a put group; at rollout_batch_size groups publish the metrics and start anew.
        `rollout/batch` is the index of the run's batch just completed (groups put // B - 1)."""
        self.kept += 1
        self.finished += 1
        self.samples += len(group.samples)
        self.reward_sum += sum(s.reward for s in group.samples)
        self.length_sum += sum(len(s.response_ids) for s in group.samples)
        v = group.weight_version
        self.min_version = v if self.min_version is None else min(self.min_version, v)
        batch = loop.config.rollout_batch_size
        if self.kept < batch:
            return
        loop.stats = BatchStats()
        elapsed = max(time.monotonic() - self.started, 1e-9)
        loop.samples_per_s = self.samples / elapsed
        put = (await loop.buffer.counters()).get("groups_put", 0)
        values = {
            "rollout/batch": float(max(put // batch - 1, 0)),
            "rollout/reward_mean": self.reward_sum / self.samples,
            "rollout/samples_per_s": loop.samples_per_s,
            "rollout/response_len_mean": self.length_sum / self.samples,
            "rollout/groups": float(self.kept),
            "rollout/prompts_generated": float(self.finished),
            "rollout/batch_time_s": elapsed,
            "rollout/engines_version": float(await loop.engines_version()),
        }
        step = self.min_version if self.min_version is not None else 0
        await loop.buffer.publish_metrics("router", step, values)


async def service_status(loop: RolloutLoop, error: str = "") -> ServiceStatus:
    """The status record; `failed` with `error` when a task died."""
    detail: dict[str, float | int | str] = {
        "groups_put_here": loop.groups_put,
        "groups_in_flight": len(loop.groups),
        "requests_in_flight": loop.in_flight,
    }
    with contextlib.suppress(RedisError):
        demand = await loop.read_demand(len(loop.groups))
        detail.update(
            groups_put=demand.put,
            groups_consumed=demand.consumed,
            trainer_version=demand.trainer_version,
            engines_version=demand.engines_version,
        )
    return ServiceStatus(
        role="router",
        state="failed" if error else loop.state,
        waiting_for="" if error else loop.waiting_for,
        since=loop.since,
        error=error or loop.error,
        detail=detail,
        pid=os.getpid(),
    )


async def status(loop: RolloutLoop) -> dict[str, Any]:
    """The loop's state; the Redis-backed fields are None while Redis is unavailable.
    `buffer_depth` is the backlog the depth bound counts (groups put, not yet consumed);
    `waiting` says when producers wait for it ("buffer full (depth N of M)")."""
    redis_fields: dict[str, Any] = dict.fromkeys(
        ("engines_version", "trainer_version", "buffer_depth", "drops", "batch", "groups_consumed")
    )
    redis_fields["waiting"] = ""
    with contextlib.suppress(RedisError):
        counters = await loop.buffer.counters()
        depth = backlog(counters)
        redis_fields = {
            "engines_version": await loop.engines_version(),
            "trainer_version": await loop.buffer.get_version("trainer"),
            "buffer_depth": depth,
            "waiting": loop.bound.sentence(depth),
            "drops": await loop.buffer.drop_counts(),
            "batch": counters.get("groups_put", 0) // loop.config.rollout_batch_size,
            "groups_consumed": counters.get("groups_consumed", 0),
        }
    return {
        "state": loop.state,
        "waiting_for": loop.waiting_for,
        "paused": loop.paused,
        "error": loop.error,
        "in_flight": loop.in_flight,
        "groups_in_flight": len(loop.groups),
        "samples_per_s": loop.samples_per_s,
        "groups_put": loop.groups_put,
        "max_buffer_depth": loop.bound.max_depth,
        "producers_waiting": loop.bound.waiting,
        "last_eval_version": loop.last_eval_version,
        "last_eval": loop.last_eval,
        **redis_fields,
    }
