"""Engine workers: registry, health, choice of worker per request, and retried forwarding.

Knows: the engines' URLs, their health and reported weight versions, requests in flight to each.
Does not know: what is being generated or why (the rollout loop and the HTTP routes decide that).

Concurrency: one aiohttp session (one connection pool) for every request to every worker, created
and closed by `start()`/`close()` inside the serving event loop; forwarded POSTs go through the
leaner `Http1Pool` instead unless `--hot-path-client aiohttp` (see http1.py for why). The health loop
(`run_health_checks`) polls `GET /model_info` of every worker every `health_interval_s`;
`health_failures` consecutive failures evict a worker from the rotation. Beside it, the stall
watch (`_watch_stalls`) takes out within `stall_timeout_s` a worker that holds requests and
answers nothing, neither them nor a quick probe (a stopped process or host), while another
serves: its waiting requests are cancelled there (the connection closed, so the engine drops
them) and asked of another worker, so a stopped engine costs its requests one bound, not the
health checks' count (~9 s). A request that fails with a connection error or a 5xx is retried
on another admitted worker, at most `max_retries` times.

Weight versions (the handshake with the weight broker): a worker gets traffic only while it
serves at least the version the pool has reached (`target_version`, the highest any admitted
worker reports). A worker added at run time, or re-answering after an eviction, that serves an
older version is registered pending; a worker whose reported version goes *down* restarted
from its load weights and is taken out at once. In both cases, with `--broker-url`, the router
registers the engine with the broker (`POST {broker}/engines`: URL, the version it serves and
whether it restarted; the router is the one owner of engine versions, the broker polls none),
which brings it to the current version; the health checks admit it once it reports that
version. An admitted worker that serves an older version than the pool's for `--broker-retry-s`
(its weight sync failed while it stayed up, e.g. an NCCL update it answered with an error; the
broker then leaves it out of its weight group) is taken out and handed to the broker the same
way: its samples would only be dropped as stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson

from services.common.auth import bearer_headers
from services.rollout_router.balancer.http1 import Http1Pool
from services.rollout_router.balancer.worker import (
    EngineRequestError,
    EngineStartupError,
    NoWorkerError,
    Worker,
    rendezvous,
    worker_id_for,
)
from services.rollout_router.config import WorkerPoolConfig
from services.rollout_router.samples import parse_version

log = logging.getLogger("tandem.router.workers")
# The cancel message a request's task gets when its worker is taken out while it waits.
TAKEN_OUT = "tandem: worker taken out of the rotation"
WAIT_NOTE_S = 30.0  # how often a start-up wait for an engine says it still waits
# A worker is stalled after this many times its slowest recent answer to GET /model_info, if
# longer than --stall-timeout-s (under load /model_info took up to 0.3 s on a 2-core host).
STALL_MARGIN = 4.0


class WorkerPool:
    """Registered engines and the forwarding of requests to them."""

    def __init__(self, config: WorkerPoolConfig) -> None:
        self.config = config
        self.workers: dict[str, Worker] = {}
        self.session: aiohttp.ClientSession | None = None
        self.http1: Http1Pool | None = None
        self.retries = 0
        self.version_reached = -1  # highest weight version an admitted worker reported
        self.paused_at = 0.0  # when POST /pause_generation through this router paused them (0: not)
        self._rr = itertools.count()
        self._health_task: asyncio.Task | None = None
        self.vet: Callable[[str], Awaitable[str]] | None = None  # URL -> why refused ("": not)

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # limit=0: no client-side cap on connections; callers bound their own concurrency.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, json_serialize=lambda o: orjson.dumps(o).decode()
        )
        if self.config.hot_path_client == "http1":
            self.http1 = Http1Pool(self.config.request_timeout_s)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self.http1 is not None:
            self.http1.close()

    def start_health_checks(self) -> None:
        self._health_task = asyncio.create_task(self.run_health_checks(), name="health")

    def health_task_problem(self) -> str:
        """'' while the health checks run; else why they stopped (`/health` answers 503)."""
        task = self._health_task
        if task is None or not task.done() or task.cancelled():
            return ""
        return f"the worker health checks stopped: {task.exception()!r}"

    # --- registry ------------------------------------------------------------------------------

    async def add(self, url: str, wait_s: float = 0.0) -> Worker:
        """Register `url` once `/model_info` answers, waiting up to `wait_s` with backoff;
        admitted at once if it serves the pool's weight version, else pending (and handed to
        the broker to be brought to that version); refused when `vet` says why."""
        url = url.rstrip("/")
        info = await self._wait_model_info(url, wait_s)
        refused = await self.vet(url) if self.vet is not None else ""
        worker = self._register(url, info)
        if refused:
            self.refuse(worker, refused)
        else:
            await self.ask_broker_to_sync(worker)
        return worker

    def refuse(self, worker: Worker, why: str) -> None:
        """No traffic for `worker` until it is registered again; `why` is said."""
        self._take_out(worker)
        worker.refused = worker.last_error = why
        log.error("refused %s: %s", worker.url, why)

    async def add_all(self, urls: list[str], wait_s: float, admit: bool = True) -> None:
        """Wait for every URL concurrently, then (`admit`) admit them in the order given (so
        round robin starts with the first); the first that never answers raises."""
        urls = [u.rstrip("/") for u in urls]
        infos = await asyncio.gather(*(self._wait_model_info(u, wait_s) for u in urls))
        for url, info in zip(urls, infos, strict=True) if admit else ():
            self._register(url, info)

    def _register(self, url: str, info: dict[str, Any]) -> Worker:
        worker = self.workers.get(worker_id_for(url)) or Worker(url, worker_id_for(url))
        worker.model_info, worker.refused = info, ""
        worker.weight_version = parse_version(info.get("weight_version"))
        worker.failures = 0
        target = self.target_version(exclude=worker)
        worker.healthy = worker.weight_version >= target
        self.workers[worker.worker_id] = worker
        if worker.healthy:
            self.version_reached = max(self.version_reached, worker.weight_version)
            log.info("admitted %s (weight version %d)", url, worker.weight_version)
        else:
            worker.last_error = self._behind(worker, target)
            log.info("registered %s pending: %s", url, worker.last_error)
        return worker

    def target_version(self, exclude: Worker | None = None) -> int:
        """The weight version a worker must serve to get traffic: the highest any admitted
        worker reports or has reported (so a pool whose engines all restarted does not fall
        back to their load weights); -1 before any."""
        admitted = (w.weight_version for w in self.admitted() if w is not exclude)
        return max(self.version_reached, *admitted, -1)

    @staticmethod
    def _behind(worker: Worker, target: int) -> str:
        return f"serves weight version {worker.weight_version}, waiting for version {target}"

    async def ask_broker_to_sync(self, worker: Worker, restarted: bool = False) -> None:
        """Register a pending worker with the weight broker (`--broker-url`), which brings it
        to the current weights: its URL, the version it serves (the router owns the engines'
        versions; the broker does not poll) and whether it restarted. Failures are logged and
        kept in `last_error`; the worker then stays pending until something else updates it."""
        if worker.healthy or not self.config.broker_url or self.session is None:
            return
        worker.broker_asked_at = time.monotonic()
        url = self.config.broker_url.rstrip("/") + "/engines"
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        body = {"url": worker.url, "weight_version": max(worker.weight_version, -1)}
        body["restarted"], headers = restarted, bearer_headers()
        try:
            async with self.session.post(url, json=body, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            log.info("asked the weight broker to sync %s", worker.url)
        except (TimeoutError, aiohttp.ClientError) as exc:
            worker.last_error += f"; POST {url} failed: {type(exc).__name__}: {exc}"
            log.warning("could not register %s with the broker: %s", worker.url, exc)

    async def add_or_pend(self, url: str) -> tuple[bool, Worker]:
        """(admitted now?, worker): a worker that does not answer within one health timeout
        is registered unhealthy, and the health checks admit it once it answers at the
        current weight version (sglang-router's background registration)."""
        url = url.rstrip("/")
        try:
            worker = await self.add(url, self.config.health_timeout_s)
            return worker.healthy, worker
        except EngineStartupError as exc:
            worker = self.workers.get(worker_id_for(url)) or Worker(url, worker_id_for(url))
            worker.healthy, worker.last_error = False, str(exc)
            self.workers[worker.worker_id] = worker
            return False, worker

    def remove(self, key: str) -> Worker:
        """Remove by id or URL; raises KeyError naming it when unknown."""
        worker = self.workers.pop(key, None) or self.workers.pop(
            worker_id_for(key.rstrip("/")), None
        )
        if worker is None:
            raise KeyError(f"no worker {key!r}")
        return worker

    def admitted(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def min_version(self) -> int:
        """Lowest weight version any admitted worker has reported (-1 when none)."""
        versions = [w.weight_version for w in self.admitted()]
        return min(versions) if versions else -1

    async def _wait_model_info(self, url: str, wait_s: float) -> dict[str, Any]:
        """Its /model_info, once it answers; a wait of more than a few seconds is said (then
        every WAIT_NOTE_S), with what the engine answered last."""
        start = time.monotonic()
        deadline, said = start + wait_s, start + 5.0 - WAIT_NOTE_S
        delay, last = 0.05, "no attempt made"
        while True:
            try:
                return await self.get_json(url, "/model_info", self.config.health_timeout_s)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if str(exc).startswith("HTTP 404"):  # a server, but no engine: no wait helps
                    raise EngineStartupError(
                        f"{url} answers GET /model_info with HTTP 404: no SGLang server or "
                        "Tandem engine is there; check --engine-urls (its host and port)"
                    ) from None
            if (now := time.monotonic()) >= said + WAIT_NOTE_S:
                said = now
                log.warning(
                    f"waiting for engine {url} to answer GET /model_info ({last}), "
                    f"{now - start:.0f} s of {wait_s:.0f} s (--engine-wait-timeout-s)"
                )
            if now + delay > deadline:
                raise EngineStartupError(
                    f"engine {url} did not answer GET /model_info within {wait_s:.0f}s "
                    f"(last failure: {last}); check --engine-urls and that the engine is running"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    # --- choice --------------------------------------------------------------------------------

    def pick(self, exclude: set[str] = frozenset(), session_id: str | None = None) -> Worker:  # type: ignore[assignment]
        """The worker for the next request, by policy, avoiding `exclude` when possible."""
        pool = self.admitted()
        if not pool:
            raise NoWorkerError("no healthy engine is registered (see GET /workers)")
        fresh = [w for w in pool if w.url not in exclude] or pool
        if session_id is not None and self.config.policy == "session_affinity":
            return rendezvous(fresh, session_id)
        start = next(self._rr) % len(fresh)
        if self.config.policy == "round_robin":
            return fresh[start]
        # Least outstanding; ties go round robin, so a sequential client spreads too.
        return min(fresh[start:] + fresh[:start], key=lambda w: w.outstanding)

    # --- forwarding ----------------------------------------------------------------------------

    async def get_json(self, url: str, path: str, timeout_s: float) -> dict[str, Any]:
        assert self.session is not None, "WorkerPool.start() was not called"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(url + path, timeout=timeout) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {body[:200]!r}")
            return orjson.loads(body)

    async def post(
        self, path: str, body: bytes, session_id: str | None = None
    ) -> tuple[int, bytes, Worker]:
        """POST raw JSON `body` to a chosen worker, retrying elsewhere on 5xx or no answer.

        Returns (status, response body, worker) of the first answer that is not retried
        (a 4xx is the caller's mistake and is returned as is).
        """
        assert self.session is not None, "WorkerPool.start() was not called"
        tried: set[str] = set()
        last = "no attempt made"
        task = asyncio.current_task()
        assert task is not None
        for attempt, worker in enumerate(self.attempts(tried, session_id)):
            worker.hold()
            worker.waiting.add(task)
            lost = taken_out = False  # lost: no connection, counts toward evicting the worker
            try:
                status, data = await self._send(worker.url, path, body)
                worker.quiet_since = worker.heard_at = time.monotonic()
                if status < 500:
                    return status, data, worker
                last = f"{worker.url}{path}: HTTP {status} {data[:200]!r}"
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                last = f"{worker.url}{path}: {type(exc).__name__}: {exc}"
                lost = isinstance(exc, aiohttp.ClientConnectionError | ConnectionError)
            except asyncio.CancelledError as exc:
                # Taken out while this request waited (e.g. a hung engine): ask another one,
                # unless the caller itself was cancelled too.
                if exc.args != (TAKEN_OUT,) or task.uncancel() > 0:
                    raise
                last = f"{worker.url}{path}: taken out while waiting ({worker.last_error})"
                taken_out = True  # the worker's last_error stays the cause, not nested in this
            finally:
                worker.outstanding -= 1
                worker.waiting.discard(task)
            if lost:  # (after leaving `waiting`: an eviction now must not cancel this request)
                self._mark_failed(worker, last)
            worker.errors += 1
            if not taken_out:  # (a take-out says once how many requests it sends elsewhere)
                worker.last_error = last
                log.warning("attempt %d failed: %s", attempt + 1, last)
        raise EngineRequestError(f"{path} failed after {len(tried)} engine(s); last: {last}")

    def attempts(self, tried: set[str], session_id: str | None = None) -> Iterator[Worker]:
        """The worker of each attempt of one request: the first by policy, then up to
        `max_retries` others (adding each to `tried`, counting the retries)."""
        for attempt in range(self.config.max_retries + 1):
            worker = self.pick(tried, session_id)
            tried.add(worker.url)
            if attempt:
                self.retries += 1
            yield worker

    async def _send(self, url: str, path: str, body: bytes) -> tuple[int, bytes]:
        if self.http1 is not None:
            return await self.http1.post(url, path, body)
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        async with self.session.post(url + path, data=body, headers=headers) as resp:
            return resp.status, await resp.read()

    async def post_json(
        self, path: str, payload: dict[str, Any], session_id: str | None = None
    ) -> tuple[Any, Worker]:
        """POST `payload` and return the decoded 200 answer; raise EngineRequestError otherwise."""
        status, data, worker = await self.post(path, orjson.dumps(payload), session_id)
        if status != 200:
            raise EngineRequestError(
                f"{worker.url}{path}: HTTP {status} {data[:200]!r}", status, data
            )
        return orjson.loads(data), worker

    async def fan_out(self, method: str, path: str, body: bytes) -> dict[str, Any]:
        """Send the same request to every registered worker; per-URL status and body."""
        assert self.session is not None

        async def one(worker: Worker) -> tuple[str, Any]:
            headers = {"Content-Type": "application/json", **bearer_headers()}
            session = self.session
            assert session is not None
            request = session.request(method, worker.url + path, data=body or None, headers=headers)
            try:
                async with request as resp:
                    return worker.url, {"status": resp.status, "body": (await resp.text())[:2000]}
            except (TimeoutError, aiohttp.ClientError) as exc:
                return worker.url, {"status": 0, "error": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(w) for w in list(self.workers.values())))
        return dict(results)

    # --- health --------------------------------------------------------------------------------

    def _mark_failed(self, worker: Worker, reason: str) -> None:
        worker.failures += 1
        worker.last_error = reason
        if worker.healthy and worker.failures >= self.config.health_failures:
            log.warning("evicted %s after %d failures: %s", worker.url, worker.failures, reason)
            self._take_out(worker)

    @staticmethod
    def _take_out(worker: Worker, why: str = "") -> None:
        """Out of the rotation (`why` said); the requests waiting on it are asked of another."""
        if why:
            worker.last_error = why
            log.warning("took %s out: %s", worker.url, why)
        worker.healthy, worker.behind_since = False, 0.0
        for task in list(worker.waiting):
            task.cancel(TAKEN_OUT)
        if worker.waiting:
            log.warning(
                "%s: %d waiting request(s) go to other workers", worker.url, len(worker.waiting)
            )

    async def check_once(self) -> None:
        """One health round over every registered worker (concurrently)."""
        target = self.target_version()

        async def check(worker: Worker) -> None:
            try:
                asked = time.monotonic()
                info = await self.get_json(worker.url, "/model_info", self.config.health_timeout_s)
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                self._mark_failed(worker, f"health check: {type(exc).__name__}: {exc}")
                return
            worker.failures = 0
            worker.heard(asked)
            worker.model_info = worker.model_info or info
            reported = parse_version(info.get("weight_version"))
            restarted = reported < worker.weight_version
            if restarted:  # from its load weights (the version it had was served: reached)
                self.version_reached = max(self.version_reached, worker.weight_version)
                had = worker.weight_version
                self._take_out(worker, f"restarted: serves weight version {reported}, had {had}")
            worker.weight_version = reported
            if worker.healthy:
                self.version_reached = max(self.version_reached, reported)
                if not self._lags(worker, target):
                    return
                lag = f"{self._behind(worker, target)}, for {self.config.broker_retry_s:g} s"
                self._take_out(worker, lag)
            if worker.refused and not await self._vetted_again(worker):
                return
            if reported >= max(target, self.version_reached):
                worker.healthy, worker.last_error = True, ""
                self.version_reached = max(self.version_reached, reported)
                log.info("re-admitted %s at weight version %d", worker.url, reported)
            elif restarted:  # at once: its weight group and fetched versions are gone
                await self.ask_broker_to_sync(worker, restarted=True)
            elif time.monotonic() >= worker.broker_asked_at + self.config.broker_retry_s:
                worker.last_error = self._behind(worker, target)
                await self.ask_broker_to_sync(worker)

        await asyncio.gather(*(check(w) for w in list(self.workers.values())))

    async def _vetted_again(self, worker: Worker) -> bool:
        """A refused engine checked again (each health round): one restarted at its URL as the
        refusal said (a larger --context-length) is refused no more, then admitted as any."""
        why = await self.vet(worker.url) if self.vet is not None else ""
        if why:
            worker.refused = worker.last_error = why
            return False
        log.info("%s passes the admission check now: no longer refused", worker.url)
        worker.refused = worker.last_error = ""
        return True

    def _lags(self, worker: Worker, target: int) -> bool:
        """Whether an admitted worker has served an older version than `target` for
        `--broker-retry-s` (a moment behind is every sync's normal course)."""
        if worker.weight_version >= target:
            worker.behind_since = 0.0
            return False
        worker.behind_since = worker.behind_since or time.monotonic()
        return time.monotonic() - worker.behind_since >= self.config.broker_retry_s

    async def run_health_checks(self) -> None:
        """The health rounds and, with `--stall-timeout-s`, the watch for stalled workers."""
        async with asyncio.TaskGroup() as tasks:
            if self.config.stall_timeout_s:
                tasks.create_task(self._watch_stalls(tasks))
            while True:
                await asyncio.sleep(self.config.health_interval_s)
                await self.check_once()

    # --- stalls --------------------------------------------------------------------------------

    async def _watch_stalls(self, tasks: asyncio.TaskGroup) -> None:
        """Every quarter of `--stall-timeout-s`: an admitted worker that holds requests and has
        answered nothing (neither them nor a probe) for a quarter of it is probed (GET
        /model_info); one silent for all of its bound (`--stall-timeout-s`, or STALL_MARGIN
        times its slowest recent answer to a probe if longer: a loaded host stretches it) while
        another worker answered meanwhile is stalled (a stopped process or host): taken out at
        once, its waiting requests asked of the others. A live engine answers the probe while it
        generates, however long its requests take; a router too busy to read answers hears no
        worker, so takes none out."""
        floor, probing = self.config.stall_timeout_s, set[str]()  # (a probe in flight each)
        while True:
            await asyncio.sleep(floor / 4)
            for worker in self.admitted():
                silent, bound = worker.unanswered_s(), max(floor, STALL_MARGIN * worker.answer_s)
                others = [w for w in self.admitted() if w is not worker]
                if silent >= bound and any(w.heard_at > time.monotonic() - silent for w in others):
                    n, flag = worker.outstanding, f"--stall-timeout-s {floor:g}"
                    why = f"stalled: answered none of its {n} requests nor GET /model_info for"
                    self._take_out(worker, f"{why} {silent:.1f} s ({flag}: stopped or hung)")
                elif silent >= floor / 4 and worker.worker_id not in probing:
                    probing.add(worker.worker_id)
                    tasks.create_task(self._probe(worker, probing, bound))

    async def _probe(self, worker: Worker, probing: set[str], timeout_s: float) -> None:
        """GET /model_info within `timeout_s`; an answer is heard (a failure is not: the
        watch counts the silence, the health checks say why)."""
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, ValueError):
            asked = time.monotonic()
            await self.get_json(worker.url, "/model_info", timeout_s)
            worker.heard(asked)
        probing.discard(worker.worker_id)
