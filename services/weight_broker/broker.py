"""WeightBroker: brings every inference engine to the trainer's newest weight version.

Ordering contract (each arrow is checked by tests/test_broker_*.py):
  1. The trainer finishes optimizer step N and pushes version N, bucket by bucket (ZMQ PUSH ->
     our PULL `intake_endpoint`). Versions only increase; a bucket that fails its HMAC or is
     malformed is dropped and counted, never applied.
  2. When all buckets of N have arrived the version is complete; older incomplete versions are
     discarded (latest wins: an engine never gets a version older than one it could get).
  3. For each engine not yet on N (concurrently): POST `/update_weights_from_zmq` naming our
     `serve_endpoint` and N. The engine pauses its generation between batches (requests that
     arrive meanwhile wait), fetches N's buckets (ZMQ DEALER -> our ROUTER), checks every name
     and shape before copying any tensor, flushes its cache, resumes, and from then on reports
     `weight_version` N in every response. No response mixes weights of two versions.
     NCCL (nccl_coordinator.py): the trainer broadcasts the whole version. SGLang servers are
     paused first and apply it bucket by bucket, then resume. Tandem's engine receives it
     into memory of its own while it keeps generating, then applies it at once; in pause mode
     `abort` it ends the requests still running at that moment (partial output, continued by
     the router on version N) instead of being paused, and in mode `in_place` it is paused
     like SGLang.
  4. Once an engine acknowledged N, its version is N here; `version:engines` in Redis is set to
     the minimum version over engines in rotation, which the router uses as its staleness gate.
  5. An engine that fails or exceeds `sync_timeout_s` is taken out of rotation (reported in
     `/state` and metrics) and retried with backoff; the others complete regardless.
  6. Late and restarted engines: `POST /engines` (the router calls it for an engine added at
     run time or found restarted) registers an engine at an unknown version; the probe loop
     (`probe_interval_s`) also finds engines whose version went down. ZMQ/disk: such an
     engine is synced to the newest version at once. NCCL: the next version forms a new
     weight group that includes it (a broadcast needs the trainer, which offers versions only
     after optimizer steps). Until an engine reports the newest version the router keeps it
     out of rotation (see services/rollout_router/workers.py).

Threads and loops: the intake thread owns the PULL socket and waits on it; the serve thread owns
the ROUTER socket and answers fetch requests one at a time; the asyncio sync loop (in the HTTP
server's event loop) waits for new complete versions or lagging engines and issues HTTP calls.
Memory is bounded by `keep_versions` complete versions (VersionStore).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq
from redis.exceptions import RedisError

from proto import WeightRequest, decode
from proto.contract import ServiceStatus
from services.common.auth import bearer_headers
from services.common.engine_info import VersionUnavailableError, weight_version
from services.sample_buffer import BufferConfig, SampleBuffer
from services.weight_broker.config import BrokerConfig
from services.weight_broker.store import VersionStore
from services.weight_broker.transports import DiskTransport, WeightTransport, ZmqTransport
from services.weight_sync.wire import AuthenticationError, parse_bucket, secret_from_env
from services.weight_sync.zmq_transport import ERROR_FRAME

log = logging.getLogger("tandem.broker")
POLL_MS = 200
RETRY_BACKOFF_S = 5.0


@dataclass
class EngineState:
    url: str
    version: int = -1
    in_rotation: bool = True
    syncing: bool = False
    last_error: str = ""
    last_sync_s: float = 0.0
    last_sync_at: float = 0.0
    last_bytes_per_s: float = 0.0
    failures: int = 0
    retry_at: float = 0.0


class WeightBroker:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.secret = secret_from_env()
        self.store = VersionStore(config.keep_versions)
        self.engines: dict[str, EngineState] = {u: EngineState(u) for u in config.engine_urls}
        self.buffer = (
            SampleBuffer(BufferConfig(redis_url=config.redis_url, run_id=config.run_id))
            if config.redis_url
            else None
        )
        self.counters = {
            "buckets_rejected": 0,
            "frames_rejected": 0,  # fetch requests and control messages that were not
            "versions_received": 0,
            "syncs_failed": 0,
        }
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.intake_endpoint = ""
        self.serve_endpoint = ""
        self._prepared = -1
        self.nccl: Any = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start_sockets(self) -> None:
        """Bind the ZMQ sockets (and start their threads); endpoints are then resolved."""
        if self.config.transport == "nccl":
            from services.weight_broker.nccl_coordinator import NcclCoordinator

            self.nccl = NcclCoordinator(self, self.config.pause_mode, self.config.nccl_load_format)
            self.intake_endpoint = self.nccl.endpoint
            log.info("NCCL control at %s", self.intake_endpoint)
            return
        intake = self._ctx.socket(zmq.PULL)
        intake.bind(self.config.intake_endpoint)
        self.intake_endpoint = intake.getsockopt_string(zmq.LAST_ENDPOINT)
        serve = self._ctx.socket(zmq.ROUTER)
        serve.setsockopt(zmq.LINGER, 0)
        serve.bind(self.config.serve_endpoint)
        self.serve_endpoint = serve.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.advertise_host and self.serve_endpoint.startswith("tcp://"):
            port = self.serve_endpoint.rsplit(":", 1)[1]
            self.serve_endpoint = f"tcp://{self.config.advertise_host}:{port}"
        if self.config.transport == "disk":
            self.transport: WeightTransport = DiskTransport(
                self.config.disk_dir, self.config.model_dir, self.config.keep_versions
            )
        else:
            self.transport = ZmqTransport(self.serve_endpoint)
        for target, sock in ((self._intake_loop, intake), (self._serve_loop, serve)):
            name = target.__name__.strip("_")
            thread = threading.Thread(target=target, args=(sock,), daemon=True, name=name)
            thread.start()
            self._threads.append(thread)
        log.info("intake %s, serving %s", self.intake_endpoint, self.serve_endpoint)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)

    # --- intake: trainer -> broker ------------------------------------------------------------

    def _intake_loop(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            if not sock.poll(POLL_MS):
                continue
            message = sock.recv_multipart(copy=False)
            try:
                header, _frames = parse_bucket(message, self.secret)
                done = self.store.add_bucket(header, message)
            except (ValueError, AuthenticationError, TypeError, IndexError) as exc:
                self.counters["buckets_rejected"] += 1
                log.error("dropped a weight bucket: %s", exc)
                continue
            if done is not None:
                self.counters["versions_received"] += 1
                log.info("version %d complete (%.1f MB)", done.version, done.nbytes / 1e6)
                self._notify()
        sock.close()

    def thread_problem(self) -> str:
        """'' while every socket thread runs; else which one died (`/health` answers 503)."""
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self._stop.is_set():
            return f"weight thread(s) {', '.join(dead)} stopped; see the broker's log"
        return ""

    def _notify(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # --- serve: engine fetches ----------------------------------------------------------------

    def _serve_loop(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            if not sock.poll(POLL_MS):
                continue
            parts = sock.recv_multipart()
            try:
                if len(parts) != 2:
                    raise ValueError(f"{len(parts) - 1} payload frames, expected 1 WeightRequest")
                request = decode(parts[1], WeightRequest)
            except ValueError as exc:
                self.counters["frames_rejected"] += 1
                sock.send_multipart([parts[0], ERROR_FRAME, str(exc).encode()])
                continue
            identity = parts[0]
            entry = self.store.get(request.version)
            if entry is None:
                msg = (
                    f"broker holds no weight version {request.version} (latest {self.store.latest})"
                )
                sock.send_multipart([identity, ERROR_FRAME, msg.encode()])
                continue
            for message in entry.messages():
                sock.send_multipart([identity, *message], copy=False)
        sock.close()

    # --- sync loop: broker -> engines ---------------------------------------------------------

    async def run_sync_loop(self) -> None:
        """Keep every engine on the newest version until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.config.sync_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=bearer_headers()) as session:
            await asyncio.gather(*(self._probe(e) for e in self.engines.values()))
            self.publish_version()
            probes = asyncio.create_task(self._probe_loop(), name="probe")
            reports = asyncio.create_task(self._status_loop(), name="status")
            try:
                if self.nccl is not None:  # push-driven: the trainer offers each version
                    await self.nccl.run(session)
                else:
                    await self._pull_loop(session)
            finally:
                probes.cancel()
                reports.cancel()
                await asyncio.gather(probes, reports, return_exceptions=True)

    async def _pull_loop(self, session: aiohttp.ClientSession) -> None:
        """ZMQ and disk: sync every engine that is not on the newest complete version."""
        assert self._wake is not None
        while True:
            target = self.store.latest
            lagging = [
                e
                for e in self.engines.values()
                if target >= 0
                and e.version != target
                and not e.syncing
                and time.monotonic() >= e.retry_at
            ]
            if lagging:
                # Prepared once per version (e.g. the disk copy), before any engine loads it.
                await asyncio.to_thread(self._prepare, target)
                await asyncio.gather(*(self._sync(session, e, target) for e in lagging))
                self.publish_version()
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)

    def _prepare(self, version: int) -> None:
        entry = self.store.get(version)
        if entry is not None and self._prepared != version:
            self.transport.prepare(entry)
            self._prepared = version

    async def _probe(self, engine: EngineState) -> None:
        """Learn an engine's current version (a freshly started engine serves its load dir)."""
        reported = await self._reported_version(engine)
        if reported is not None:
            engine.version = reported

    async def _reported_version(self, engine: EngineState, quiet: bool = False) -> int | None:
        """The version the engine serves (`/model_info`, then the older routes), else None."""
        timeout_s = min(self.config.sync_timeout_s, 10.0)
        try:
            return int(await asyncio.to_thread(weight_version, engine.url, timeout_s))
        except (VersionUnavailableError, ValueError) as exc:
            engine.last_error = f"probe failed: {exc}"
            (log.debug if quiet else log.warning)("engine %s: %s", engine.url, engine.last_error)
            return None

    async def _probe_loop(self) -> None:
        """Find engines that restarted (reported version below what they acknowledged)."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            idle = [e for e in self.engines.values() if not e.syncing and e.version >= 0]
            if self.nccl is not None and self.nccl.busy:
                continue
            started = time.time()
            reported = await asyncio.gather(*(self._reported_version(e, quiet=True) for e in idle))
            for engine, version in zip(idle, reported, strict=True):
                # Skip answers that raced with a sync that finished meanwhile.
                if version is None or engine.syncing or engine.last_sync_at > started:
                    continue
                if version < engine.version:
                    log.warning(
                        "engine %s restarted: serves version %d, had %d",
                        engine.url,
                        version,
                        engine.version,
                    )
                    self.add_engine(engine.url)

    async def _sync(
        self, session: aiohttp.ClientSession, engine: EngineState, version: int
    ) -> None:
        entry = self.store.get(version)
        if entry is None or self._prepared != version:
            return
        engine.syncing = True
        start = time.monotonic()
        try:
            await self.transport.update(session, engine.url, version)
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            self.mark_failed(engine, f"update to version {version} failed: {exc!r}")
        else:
            self.mark_synced(engine, version, time.monotonic() - start, entry.nbytes)
        finally:
            engine.syncing = False

    def mark_synced(self, engine: EngineState, version: int, elapsed_s: float, nbytes: int) -> None:
        engine.version = version
        engine.in_rotation = True
        engine.last_error = ""
        engine.last_sync_s = elapsed_s
        engine.last_sync_at = time.time()
        engine.last_bytes_per_s = nbytes / elapsed_s if elapsed_s > 0 else 0.0
        log.info("engine %s on version %d in %.3fs", engine.url, version, elapsed_s)

    def mark_failed(self, engine: EngineState, error: str) -> None:
        """Take an engine out of rotation (reported in /state), retry after a backoff."""
        engine.in_rotation = False
        engine.failures += 1
        engine.last_error = error
        engine.retry_at = time.monotonic() + RETRY_BACKOFF_S
        self.counters["syncs_failed"] += 1
        log.error("engine %s out of rotation: %s", engine.url, error)

    def publish_version(self) -> None:
        versions = [e.version for e in self.engines.values() if e.in_rotation and e.version >= 0]
        if self.buffer is not None and versions:
            self.buffer.set_version("engines", min(versions))

    def status(self) -> ServiceStatus:
        """What the broker waits for: engines that are not on the newest version (and why),
        else the trainer's next version."""
        latest = self.store.latest
        behind = [e for e in self.engines.values() if latest >= 0 and e.version != latest]
        if behind:
            waiting = "engines on weight version {}: {}".format(
                latest,
                "; ".join(
                    f"{e.url} serves {e.version}"
                    + (" (syncing)" if e.syncing else "")
                    + (f", last error: {e.last_error[:200]}" if e.last_error else "")
                    for e in behind
                ),
            )
            state = "syncing"
        else:
            first = "first" if latest < 0 else "next"
            waiting = f"the trainer's {first} weight version (at {self.intake_endpoint})"
            state = "idle"
        detail: dict[str, float | int | str] = {"version": latest, "engines": len(self.engines)}
        return ServiceStatus(role="broker", state=state, waiting_for=waiting, detail=detail)

    async def _status_loop(self, interval_s: float = 2.0) -> None:
        """Report `status()` to Redis for `tandem up`'s progress watchdog."""
        if self.buffer is None:
            return
        since, last = time.time(), ""
        while True:
            status = self.status()
            if status.waiting_for != last:
                since, last = time.time(), status.waiting_for
            status.since, status.pid = since, os.getpid()
            with contextlib.suppress(RedisError):
                await asyncio.to_thread(self.buffer.set_status, status, 4 * interval_s)
            await asyncio.sleep(interval_s)

    # --- engines and state --------------------------------------------------------------------

    def add_engine(self, url: str) -> EngineState:
        """Register an engine (late joiner or restart); it is synced to the newest version."""
        url = url.rstrip("/")
        engine = self.engines.setdefault(url, EngineState(url))
        engine.version = -1  # unknown until it acknowledges a version
        engine.in_rotation = True
        engine.retry_at = 0.0
        if self.nccl is not None:  # it has no (or a stale) weight group: form a new one
            self.nccl.members = []
        self.publish_version()
        self._notify()
        return engine

    def remove_engine(self, url: str) -> bool:
        removed = self.engines.pop(url.rstrip("/"), None) is not None
        self.publish_version()
        return removed

    def state(self) -> dict:
        return {
            "version": self.store.latest,
            "waiting_for": self.status().waiting_for,
            "intake_endpoint": self.intake_endpoint,
            "serve_endpoint": self.serve_endpoint,
            "counters": dict(self.counters),
            "engines": [vars(e).copy() for e in self.engines.values()],
        }
