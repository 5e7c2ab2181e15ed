"""What the router tells an operator: `GET /metrics` (Prometheus text) and the rollout loop's
timeline spans (one per rollout batch, one per wait of the loop).

`LoopObserver` is fed by the rollout loop (a group put, a request answered, a state change);
it never blocks the event loop: counters are in memory and spans go to the timeline's
background writer. The gauges (versions, buffer depth, drops) are read from Redis and the worker
pool when `/metrics` is scraped.
"""

from __future__ import annotations

import time

import redis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from redis.exceptions import RedisError

from proto import SampleGroup
from services.common.metrics import CONTENT_TYPE, Gauge, Metrics, gauge, labels
from services.rollout_router.balancer.workers import WorkerPool
from services.rollout_router.rollout.report import LoopSnapshot
from services.sample_buffer import AsyncSampleBuffer
from services.sample_buffer.keys import backlog
from services.sample_buffer.password import password_option
from services.sample_buffer.timeline import Timeline

router = APIRouter()
GENERATING = "generating"  # the loop state in which engines get work; any other is idle


class LoopObserver:
    """Counters, request latency, time per loop state and timeline spans of one rollout loop."""

    def __init__(self, buffer: AsyncSampleBuffer | None) -> None:
        self.metrics = Metrics("tandem_router_")
        self.metrics.counter("groups_put", "Sample groups put into the buffer by rollouts.")
        self.metrics.counter("samples_generated", "Samples in the groups put.")
        self.metrics.counter("tokens_generated", "Response tokens in the groups put.")
        self.metrics.counter(
            "rollout_state_seconds", "Seconds the rollout loop spent per state.", labelled=True
        )
        self.request_seconds = self.metrics.histogram(
            "request_seconds", "Latency of the rollout's /generate requests to the engines."
        )
        # The timeline's background writer is a thread: it has a blocking client of its own.
        self.timeline = (
            Timeline(
                redis.Redis.from_url(buffer.config.redis_url, **password_option()),
                buffer.config.run_id,
                "router",
            )
            if buffer is not None
            else None
        )
        self.started = time.time()
        self.batch_started, self.batch_groups, self.batch_index = time.time(), 0, 0

    def group_put(self, group: SampleGroup, batch_size: int) -> None:
        """Count a put group; every `batch_size` groups, a `rollout batch` span."""
        self.metrics.inc("groups_put")
        self.metrics.inc("samples_generated", len(group.samples))
        self.metrics.inc("tokens_generated", sum(len(s.response_ids) for s in group.samples))
        self.batch_groups += 1
        if self.batch_groups >= batch_size:
            now = time.time()
            self._span(
                f"rollout batch {self.batch_index}",
                self.batch_started,
                now,
                "batches",
                groups=self.batch_groups,
                weight_version=group.weight_version,
            )
            self.batch_started, self.batch_groups = now, 0
            self.batch_index += 1

    def state_left(self, state: str, since: float, waiting_for: str) -> None:
        """The loop leaves `state` (entered at `since`): its time, and a span if it waited."""
        now = time.time()
        self.metrics.inc("rollout_state_seconds", now - since, labels(state=state))
        if state != GENERATING and now - since > 0.001:
            self._span(state, since, now, "waits", waiting_for=waiting_for[:200])

    def idle_fraction(self, state: str, since: float) -> float:
        """Share of the loop's life spent outside `generating` (the current state included)."""
        spent = self.metrics.counters["rollout_state_seconds"]
        now = time.time()
        total = max(now - self.started, 1e-9)
        busy = spent.get(labels(state=GENERATING), 0.0) + (
            now - since if state == GENERATING else 0
        )
        return min(max(1.0 - busy / total, 0.0), 1.0)

    def _span(self, name: str, start: float, end: float, lane: str, **args: object) -> None:
        if self.timeline is not None:
            self.timeline.add(name, start, end, lane, **args)

    def close(self) -> None:
        if self.timeline is not None:
            self.timeline.close()


async def redis_gauges(buffer: AsyncSampleBuffer) -> tuple[list[Gauge], list[Gauge]]:
    """Buffer depth, versions, staleness (gauges) and drops by reason (totals), from Redis."""
    trainer = await buffer.get_version("trainer")
    engines = await buffer.get_version("engines")
    counters = await buffer.counters()
    depth = await buffer.depth()
    gauges = [  # (buffer_depth means what GET /rollout/status and the dashboard mean by it)
        gauge(
            "buffer_depth",
            "Groups put and not yet consumed by the trainer (what --max-buffer-depth bounds).",
            backlog(counters),
        ),
        gauge("groups_unacked", "Groups in the buffer stream not yet acked (trained).", depth),
        gauge("trainer_version", "Weight version the trainer last published.", trainer),
        gauge("engines_version", "Weight version every engine in rotation has loaded.", engines),
        gauge(
            "staleness_versions",
            "Versions the engines lag the trainer (trainer_version - engines_version).",
            max(trainer - engines, 0),
        ),
    ]
    drops = {labels(reason=r): float(n) for r, n in (await buffer.drop_counts()).items()}
    totals = [
        ("drops", "Samples dropped in this run, by reason (router and trainer).", drops),
        ("run_groups_put", "Groups put in this run (all routers).", _one(counters, "groups_put")),
        (
            "run_groups_consumed",
            "Groups the trainer consumed in this run.",
            _one(counters, "groups_consumed"),
        ),
    ]
    return gauges, totals


def _one(counters: dict[str, int], name: str) -> dict:
    return {(): float(counters.get(name, 0))}


async def render(
    loop: tuple[LoopSnapshot, LoopObserver] | None,
    pool: WorkerPool | None,
    buffer: AsyncSampleBuffer | None,
) -> str:
    """The exposition text; `loop`: the rollout loop's snapshot and observer (None: no loop)."""
    workers = list(pool.workers.values()) if pool is not None else []
    versions = {labels(engine=w.url): float(w.weight_version) for w in workers}
    outstanding = {labels(engine=w.url): float(w.outstanding) for w in workers}
    gauges: list[Gauge] = [
        ("engine_weight_version", "Weight version each engine last reported.", versions),
        ("engine_outstanding_requests", "Requests in flight per engine.", outstanding),
    ]
    totals: list[Gauge] = []
    if buffer is not None:
        try:
            more, totals = await redis_gauges(buffer)
            gauges += [*more, gauge("redis_up", "1 while the run's Redis answers.", 1)]
        except RedisError:  # the scrape still shows the router's own numbers
            gauges.append(gauge("redis_up", "1 while the run's Redis answers.", 0))
    if loop is None:
        return Metrics("tandem_router_").render(gauges, totals)
    snap, observe = loop
    gauges += [
        gauge(
            "requests_in_flight", "Rollout /generate requests in flight.", snap.requests_in_flight
        ),
        gauge(
            "groups_in_flight",
            "Rollout groups started and not yet put or dropped.",
            snap.groups_in_flight,
        ),
        gauge(
            "rollout_idle_fraction",
            "Share of the rollout loop's time outside the generating state (waiting for the "
            "trainer, weights, buffer room, engines, or paused).",
            observe.idle_fraction(snap.state, snap.since),
        ),
        (
            "rollout_state",
            "1 for the rollout loop's current state.",
            {labels(state=snap.state): 1.0},
        ),
    ]
    return observe.metrics.render(gauges, totals)


@router.get("/metrics", tags=["observability"], response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the router, its rollout loop and the run's Redis state."""
    state = request.app.state
    control = getattr(state, "control", None)
    loop = (control.loop.snapshot(), control.loop.observe) if control is not None else None
    text = await render(loop, getattr(state, "pool", None), getattr(state, "buffer", None))
    return Response(text, media_type=CONTENT_TYPE)
