"""WeightBroker: brings every inference engine to the trainer's newest weight version.

The ordering contract it keeps (versions only increase, latest wins, an engine that fails is
taken out of rotation and retried, `version:engines` is the minimum over engines in rotation)
is in docs/architecture.md, "Weight sync"; tests/test_broker_*.py check each point.

Loop: `run` asks the transport (transports.py) for the version to sync to, has it sync the
engines not on it, not syncing and whose retry is due, and marks each outcome as it ends
(bucket transports: one task per engine, so an engine stopped mid-sync is left behind until
`--sync-timeout-s` while the others take each later version; NCCL: one broadcast per version
to the engines due, each recorded as it answers, one stopped or slow left behind within
`MEMBER_CHECK_S` plus the broadcast's time: nccl_transport.py). A sync that ends and
`add_engine` set the loop's `wake` so neither waits for the next poll. The transport's socket loops and the
Redis loop run beside it: if one of them fails, `run` raises and `/health` says so.

Redis is only touched off the event loop (`asyncio.to_thread`, each call bounded by
`--redis-call-timeout-s`): the Redis loop publishes `version:engines` as soon as it changes,
reads the trainer's announced version and writes the status (`Membership.report`); a Redis that
stops answering delays those, never the syncs, the sockets or `/health`.

One broker per run (with Redis): a second one (a service scaled to two, a rolling update, one
started by hand) wrote its own `version:engines` and status over the first's, so the broker holds
its run membership (`sample_buffer.membership`: the run's broker lease, the broker's term of the
run contract, its status writes): the lease is taken before it serves (`__main__.start`; another
one's start is refused, exit 2, naming it), renewed beside the loops; a broker that finds another
holding it (it was stopped, or cut off from Redis, past the expiry) stops its loop, `/health` 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from redis.exceptions import RedisError

from proto.contract import RunContract, ServiceStatus
from services.common.auth import bearer_headers
from services.common.long_wait import LongWait
from services.sample_buffer import SampleBuffer
from services.sample_buffer.keys import LEASE_RENEW_S
from services.sample_buffer.membership import Membership
from services.sample_buffer.refusals import hint_of
from services.weight_broker.config import BrokerConfig
from services.weight_broker.nccl_transport import NcclTransport
from services.weight_broker.transports import DiskTransport, Outcome, WeightTransport, ZmqTransport
from services.weight_sync.wire import secret_from_env

UNSIGNED = "TANDEM_WEIGHT_SECRET is not set: the weight intake takes unsigned versions from any "
UNSIGNED += (
    "local process; set the same secret for trainer, broker and engines (tandem up sets one)"
)
RESEND_AFTER_S = 4.0  # an announced version still missing after this is asked for again
log = logging.getLogger("tandem.broker")


def make_transport(config: BrokerConfig, counters: dict[str, int]) -> WeightTransport:
    """The configured transport, its sockets bound; `counters` is the broker's (it counts
    rejected buckets and frames there)."""
    if config.sync.transport == "nccl":
        return NcclTransport(config, counters)
    transport = (
        DiskTransport(config.sync.disk_dir, config.sync.model_dir, config.sync.keep_versions)
        if config.sync.transport == "disk"
        else ZmqTransport(config.sync.keep_versions)
    )
    transport.bind(config, counters)
    return transport


@dataclass
class EngineState:
    url: str
    version: int = -1
    in_rotation: bool = True
    syncing: bool = False
    target: int = -1  # the version it syncs to (while `syncing`)
    last_error: str = ""
    last_sync_s: float = 0.0
    last_bytes_per_s: float = 0.0
    last_sync_at: float = 0.0  # wall time the last sync ended (read by server.py)
    failures: int = 0
    retry_at: float = 0.0


class WeightBroker:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.engines: dict[str, EngineState] = {
            u: EngineState(u) for u in config.endpoints.engine_urls
        }
        self.buffer = SampleBuffer(config.buffer_config()) if config.run.redis_url else None
        self.lease = Membership(self.buffer, "broker", log.warning) if self.buffer else None
        # frames_rejected: fetch requests and control messages that were not; versions_refused:
        # complete, but not the trainer's (see `_unpublished`)
        names = "buckets_rejected frames_rejected versions_received syncs_failed versions_refused"
        self.counters = dict.fromkeys(names.split(), 0)
        self.latest = -1  # the newest version the trainer handed us
        self.transport = make_transport(config, self.counters)
        self._unpublished_engines = False  # version:engines not written yet (the Redis loop)
        self._redis_due = asyncio.Event()  # set when the Redis loop has something to write
        self.announced = -1  # version:trainer as last read (the Redis loop)
        self._resend = -1  # a version to ask the trainer for again (the Redis loop writes it)
        self._missing, self._missing_since = -1, 0.0  # an announced version not received
        self.long_wait = LongWait(log.warning)  # (run apart, its console is all there is)
        self._wake = asyncio.Event()
        self.on_sync: Callable[[EngineState], None] | None = None  # server.py: SyncObserver.record
        self.unsigned = "" if secret_from_env() else UNSIGNED  # said at start and on /health

    # --- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep every engine on the newest version until cancelled."""
        self._wake, self._redis_due = asyncio.Event(), asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.config.sync.sync_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=bearer_headers()) as session:
            try:
                async with asyncio.TaskGroup() as loops:  # one fails: every loop stops
                    loops.create_task(self._sync_loop(session))
                    loops.create_task(self._redis_loop())
                    loops.create_task(self.transport.serve())
                    loops.create_task(self._lease_loop())
            except ExceptionGroup as failed:
                log.error("the broker's loop stopped", exc_info=failed)
                raise failed.exceptions[0] from None

    def hold_lease(self) -> None:
        """Take the run's broker lease (ValueError naming another broker that holds it), renew
        it in a thread (`_lease_loop` stops the broker once another holds it) and state the
        broker's term of the run contract, how versions arrive (the trainer's
        `--weight-transport`; `ContractMismatchError` names it). Holding it, the broker deletes
        `version:engines`, the last broker's word on engines that may be gone: a resume's
        engines start on the model's weights, which the router took for that version's. Until
        this broker syncs its engines, the router reads what they report."""
        if self.lease is not None:
            intake = "nccl" if self.config.sync.transport == "nccl" else "zmq"  # disk takes zmq's
            contract = RunContract(weight_transport=intake)
            self.lease.buffer.wait_ready(30.0)
            self.lease.join(lambda _holder: None, contract)  # (`_lease_loop` reads `lost_to`)
            self.lease.buffer.forget_version("engines")

    async def _lease_loop(self) -> None:
        """Until another broker holds the lease: ValueError saying so."""
        while not (self.lease and self.lease.lost_to):
            await asyncio.sleep(LEASE_RENEW_S)
        raise ValueError(self.lease.lost())

    async def _sync_loop(self, session: aiohttp.ClientSession) -> None:
        async with asyncio.TaskGroup() as syncs:  # (bucket transports: one task per engine)
            while True:
                await self._sync_once(session, syncs)

    async def _sync_once(self, session: aiohttp.ClientSession, syncs: asyncio.TaskGroup) -> None:
        """Bring the engines not on the newest version, and not syncing, to it. Bucket
        transports sync each engine on its own task, recorded as it ends: a stopped or slow
        engine holds back no other engine and no later version. NCCL brings the engines due
        together (one broadcast), each outcome its own."""
        version = await self.transport.next_version(self._wake)
        if version < 0:
            return
        if why := await self._unpublished(version):
            self.counters["versions_refused"] += 1
            log.error("refused weight version %d: %s", version, why)
            await self.transport.refuse(version, why)
            return
        self.latest = version
        now, engines = time.monotonic(), self.engines.values()
        due = [e for e in engines if e.version < version and not e.syncing and now >= e.retry_at]
        if not self.transport.keeps_versions:
            await self._sync_engines(session, due, version)
            return
        for engine in due:
            syncs.create_task(self._sync_engines(session, [engine], version))

    async def _sync_engines(
        self, session: aiohttp.ClientSession, due: list[EngineState], version: int
    ) -> None:
        """Sync `due` to `version` and mark each outcome (an engine removed meanwhile is not).
        NCCL is asked even with none due: its offer is answered (`abort`), or the trainer that
        offered it waits for a command until its timeout (bucket transports ask for one engine
        at a time, never none)."""
        for engine in due:
            engine.syncing, engine.target = True, version
        try:
            outcomes = await self.transport.sync(session, [e.url for e in due], version)
        finally:
            for engine in due:
                engine.syncing = False
        for engine in due:
            if engine.url in outcomes and self.engines.get(engine.url) is engine:
                self.mark(engine, version, outcomes[engine.url])
        self.publish_version()
        self._wake.set()  # a newer version may have come while these synced

    async def _unpublished(self, version: int) -> str:
        """Why `version` cannot be the trainer's, else ''. The trainer announces V in Redis
        (`version:trainer`) right after sending it, so a version more than one ahead of the
        announced one (once there is one) came from elsewhere."""
        published = -1
        if version > self.latest:
            published = await asyncio.to_thread(self._trainer_version)
        if published >= 0 and version > published + 1:
            return f"the trainer published version {published}; {version} is not its next"
        return ""

    def _trainer_version(self) -> int:
        """`version:trainer` in Redis; -1 without Redis, before a trainer, or when Redis is
        unavailable (the HMAC still guards the intake)."""
        if self.buffer is None:
            return -1
        try:
            return self.buffer.get_version("trainer")
        except RedisError as exc:
            log.warning("cannot read the trainer's version from Redis: %s", exc)
            return -1

    def mark(self, engine: EngineState, version: int, outcome: Outcome) -> None:
        """An engine's outcome: on `version`, or out of rotation (reported in /state) until a
        retry after the transport's backoff."""
        engine.last_error = outcome.error
        if outcome.error:
            engine.in_rotation, engine.failures = False, engine.failures + 1
            engine.retry_at = time.monotonic() + self.transport.retry_backoff_s
            self.counters["syncs_failed"] += 1
            log.error("engine %s out of rotation: %s", engine.url, outcome.error)
            return
        engine.version, engine.in_rotation, engine.last_sync_at = version, True, time.time()
        engine.last_sync_s = outcome.elapsed_s
        engine.last_bytes_per_s = outcome.nbytes / outcome.elapsed_s if outcome.elapsed_s else 0.0
        if self.on_sync is not None:
            self.on_sync(engine)
        log.info("engine %s on version %d in %.3fs", engine.url, version, outcome.elapsed_s)
        for other in self.engines.values():  # left behind: out of the gate's minimum
            if other.syncing and other.target < version and other.in_rotation:
                other.in_rotation = False
                other.last_error = (
                    f"left behind: still syncing version {other.target} while {engine.url} "
                    f"took {version} (stopped or slow; --sync-timeout-s bounds its sync)"
                )
                log.warning("engine %s out of rotation: %s", other.url, other.last_error)

    def publish_version(self) -> None:
        """Have the Redis loop write `version:engines` (it keeps trying while Redis is
        unavailable: the sync loop must outlive a Redis restart)."""
        self._unpublished_engines = True
        self._redis_due.set()

    async def _write_engines_version(self, buffer: SampleBuffer) -> None:
        """In the Redis loop: `version:engines`, the minimum over engines in rotation whose
        version is known (read on the event loop, which alone changes the engines); nothing
        while one in rotation has its first sync under way."""
        engines = [e for e in self.engines.values() if e.in_rotation]
        versions = [e.version for e in engines if e.version >= 0]
        self._unpublished_engines = False  # (an engine's first sync, when it ends, publishes)
        if not versions or any(e.syncing and e.version < 0 for e in engines):
            return
        try:
            await asyncio.to_thread(buffer.set_version, "engines", min(versions))
        except RedisError as exc:
            self._unpublished_engines = True
            hint = hint_of(exc)  # (its disk full: MISCONF)
            log.warning("cannot publish the engines' version to Redis (retried): %s%s", exc, hint)

    # --- engines and state --------------------------------------------------------------------

    def add_engine(self, url: str, version: int = -1, restarted: bool = False) -> EngineState:
        """Register an engine at the version it serves (-1: unknown); the loop brings it to the
        newest, and until then it is out of rotation (the gate follows the engines that serve
        the newest; one resumed after a stop must not pull it back). A restarted engine holds
        nothing the transport knew of it."""
        url = url.rstrip("/")
        engine = self.engines.setdefault(url, EngineState(url))
        if restarted or 0 <= version < engine.version:
            self.transport.forget(url)
            log.warning("engine %s restarted: serves version %d", url, version)
        engine.version, engine.retry_at = version, 0.0
        engine.in_rotation = version >= self.latest
        self.publish_version()
        self._wake.set()
        return engine

    def remove_engine(self, url: str) -> bool:
        url = url.rstrip("/")
        removed = self.engines.pop(url, None) is not None
        self.transport.forget(url)
        self.publish_version()
        return removed

    def status(self) -> ServiceStatus:
        """What the broker waits for: engines that are not on the newest version (and why),
        else the trainer's next version, naming one the trainer announced that never came."""
        latest = self.latest
        behind = [e for e in self.engines.values() if latest >= 0 and e.version != latest]
        announced = self.announced
        if behind:
            engines = "; ".join(
                f"{e.url} serves {e.version}"
                + (" (syncing)" if e.syncing else "")
                + (f", last error: {e.last_error[:200]}" if e.last_error else "")
                for e in behind
            )
            waiting = f"engines on weight version {latest}: {engines}"
            state = "syncing"
            now = time.monotonic()
            if not self.transport.keeps_versions and any(  # (NCCL: an engine registered again)
                not e.syncing and now >= e.retry_at for e in behind
            ):
                waiting += "; the trainer is asked to send it again (this broker keeps no copy)"
                self._ask_resend(latest)
        elif announced > max(latest, 0):
            why = (  # (a trainer with another TANDEM_WEIGHT_SECRET: each re-send is dropped)
                f"its buckets are dropped: {self.transport.last_rejected}"
                if self.transport.last_rejected
                else "it started after the trainer sent it?"
            )
            waiting = (
                f"weight version {announced}, which the trainer announced but this broker has "
                f"not received ({why}); engines stay on "
                f"{latest if latest >= 0 else 'their load weights'}. The trainer is asked to "
                "send it again (it does while it waits for samples)"
            )
            state = "waiting"
            self._ask_resend(announced)
        elif not self.engines:  # (an authorised DELETE /engines of the last one, too)
            waiting = "an engine to sync: none is registered (--engine-urls or POST /engines)"
            state = "waiting"
        else:
            first = "first" if latest < 0 else "next"
            waiting = f"the trainer's {first} weight version (at {self.transport.intake_endpoint})"
            state = "idle"
        detail: dict[str, float | int | str] = {"version": latest, "engines": len(self.engines)}
        return ServiceStatus(role="broker", state=state, waiting_for=waiting, detail=detail)

    def _ask_resend(self, version: int) -> None:
        """A version the trainer announced has not come for `RESEND_AFTER_S` (lost with a
        broker restart): ask for it again (`version:resend`, written by the Redis loop; see the
        trainer's intake wait)."""
        now = time.monotonic()
        if self._missing != version:
            self._missing, self._missing_since = version, now
        elif now - self._missing_since >= RESEND_AFTER_S:
            self._resend = version

    async def _redis_loop(self, interval_s: float = 2.0) -> None:
        """Everything the broker writes to Redis, off the event loop: `version:engines` when
        it changes (and, after a failed write, again at each tick), and every `interval_s` the
        trainer's announced version and `status()` (for `tandem up`'s progress watchdog)."""
        if self.buffer is None or self.lease is None:
            return
        buffer, lease = self.buffer, self.lease
        since, last, next_status = time.time(), "", 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(next_status - time.monotonic(), 0)):
                    await self._redis_due.wait()
            self._redis_due.clear()
            if self._unpublished_engines:
                await self._write_engines_version(buffer)
            if time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + interval_s
            self.announced = await asyncio.to_thread(self._trainer_version)
            status = self.status()
            if status.waiting_for != last:
                since, last = time.time(), status.waiting_for
            self.long_wait.check(status.state, status.waiting_for, since)
            status.since, status.pid = since, os.getpid()
            with contextlib.suppress(RedisError):
                await asyncio.to_thread(lease.report, status, 4 * interval_s)
                if self._resend >= 0:
                    await asyncio.to_thread(buffer.set_version, "resend", self._resend)
                    self._resend = -1

    def state(self) -> dict:
        engines = [vars(e).copy() for e in self.engines.values()]
        for engine in engines:  # JSON has no infinity: a retry that waits for registration
            engine["retry_at"] = None if math.isinf(engine["retry_at"]) else engine["retry_at"]
        return {
            "version": self.latest,
            "waiting_for": self.status().waiting_for,
            "intake_endpoint": self.transport.intake_endpoint,
            "serve_endpoint": self.transport.serve_endpoint,
            "counters": dict(self.counters),
            "engines": engines,
        }
