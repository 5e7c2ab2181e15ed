"""Broker side of the NCCL weight path: `NcclCoordinator`.

The trainer offers each version on the control socket (ZMQ ROUTER at the broker's intake
endpoint). For one version, in this order:
  1. If the set of engines changed or the last version failed, (re)form the weight group:
     answer `init` to the trainer and, concurrently, POST `/init_weights_update_group` to every
     engine in rotation (rank_offset = 1 + the TP ranks before it; world = 1 + all TP ranks).
  2. Pause generation on every engine (`/pause_generation`, configured mode) unless mode "none".
  3. For each bucket k: POST `/update_weights_from_distributed` (names, dtypes, shapes,
     group_name, weight_version; flush_cache on the last bucket) to every engine, then tell the
     trainer `broadcast k`; wait for the trainer's ack and every engine's answer.
  4. `/continue_generation`, then `done` to the trainer; engines are on the version.
A failure or timeout anywhere takes the failing engine out of rotation, answers `abort` to the
trainer (the other engines keep serving the version they had or, after their last bucket, the
new one) and forces a fresh group for the next version. No step waits longer than
`sync_timeout_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import aiohttp
import zmq
import zmq.asyncio

from proto import NcclAck, NcclCommand, NcclOffer, WeightBucketHeader, decode, encode
from services.weight_broker.broker import EngineState, WeightBroker
from services.weight_broker.store import header_nbytes

log = logging.getLogger("tandem.broker.nccl")
# Tries per version: the first, plus one with a fresh group if an engine failed during it.
MAX_ATTEMPTS = 2


class NcclCoordinator:
    def __init__(self, broker: WeightBroker, pause_mode: str) -> None:
        self.broker = broker
        self.pause_mode = pause_mode
        self.timeout_s = broker.config.sync_timeout_s
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(broker.config.intake_endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.members: list[str] = []  # engine URLs of the current group, in rank order
        self.group_name = ""
        self._generation = itertools.count()
        self._tp_size: dict[str, int] = {}
        self.busy = False  # a version is being synced (the broker's probes wait meanwhile)

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            identity, payload = await self.socket.recv_multipart()
            try:
                offer = decode(payload, NcclOffer)
            except ValueError:  # e.g. a late ack of an aborted version
                log.warning("ignored a message that is not a version offer")
                continue
            try:
                await self.sync_version(session, identity, offer)
            except Exception as exc:  # keep coordinating later versions whatever broke this one
                log.exception("version %d: unexpected error", offer.version)
                abort = NcclCommand(action="abort", version=offer.version, message=repr(exc))
                await self._command(identity, abort)

    async def sync_version(
        self, session: aiohttp.ClientSession, identity: bytes, offer: NcclOffer
    ) -> None:
        """Bring every engine in rotation to `offer.version`; see the module docstring."""
        self.busy = True
        try:
            await self._sync_version(session, identity, offer)
        finally:
            self.busy = False

    async def _sync_version(
        self, session: aiohttp.ClientSession, identity: bytes, offer: NcclOffer
    ) -> None:
        start = time.monotonic()
        error = ""
        for attempt in range(MAX_ATTEMPTS):
            # An engine taken out stays out until re-registered (POST /engines): a dead member
            # would otherwise make every version wait for its timeout.
            engines = [e for e in self.broker.engines.values() if e.in_rotation]
            if not engines:
                error = error or "no engine in rotation"
                break
            try:
                await self._attempt(session, identity, offer, engines, attempt)
            except (RuntimeError, TimeoutError) as exc:
                error = str(exc) or repr(exc)
                log.error("version %d attempt %d failed: %s", offer.version, attempt, error)
                self.members = []  # a fresh group, without engines that failed
                continue
            self._finish(offer, engines, time.monotonic() - start)
            await self._command(identity, NcclCommand(action="done", version=offer.version))
            return
        await self._command(
            identity, NcclCommand(action="abort", version=offer.version, message=error)
        )
        self.broker.publish_version()

    async def _attempt(self, session, identity, offer, engines, attempt) -> None:  # type: ignore[no-untyped-def]
        paused = False
        try:
            if [e.url for e in engines] != self.members:
                await self._form_group(session, identity, offer, engines, attempt)
            await self._each(session, engines, self._pause)
            paused = True
            for index, bucket in enumerate(offer.buckets):
                await self._bucket(session, identity, offer, engines, attempt, index, bucket)
        finally:
            if paused:  # engines that failed are out of rotation; resume the others
                await self._each(session, engines, self._continue, ignore_errors=True)

    def _finish(self, offer: NcclOffer, engines: list[EngineState], elapsed_s: float) -> None:
        nbytes = sum(
            header_nbytes(WeightBucketHeader(version=0, bucket_index=0, num_buckets=1, tensors=b))
            for b in offer.buckets
        )
        for engine in engines:
            self.broker.mark_synced(engine, offer.version, elapsed_s, nbytes)
        self.broker.store.latest = offer.version
        self.broker.publish_version()
        log.info("version %d on %d engines in %.3fs", offer.version, len(engines), elapsed_s)

    # --- steps ----------------------------------------------------------------------------------

    async def _form_group(self, session, identity, offer, engines, attempt) -> None:  # type: ignore[no-untyped-def]
        unknown = [e for e in engines if e.url not in self._tp_size]
        infos = [self._get(session, f"{e.url}/get_server_info") for e in unknown]
        for engine, info in zip(unknown, await self._gather(infos, unknown), strict=True):
            self._tp_size[engine.url] = int(info.get("tp_size", 1))
        world = 1 + sum(self._tp_size[e.url] for e in engines)
        self.group_name = f"tandem_weights_{next(self._generation)}"
        await self._command(identity, NcclCommand(
            action="init", version=offer.version, attempt=attempt, world_size=world,
            group_name=self.group_name, timeout_s=self.timeout_s / 2,
        ))  # fmt: skip
        offsets = itertools.accumulate([1] + [self._tp_size[e.url] for e in engines])
        calls = [
            self._post(
                session,
                engine,
                "/init_weights_update_group",
                {
                    "master_address": offer.master_address,
                    "master_port": offer.master_port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": offer.backend,
                },
            )
            for engine, offset in zip(engines, offsets, strict=False)
        ]
        await self._gather(calls, engines)
        self.members = [e.url for e in engines]

    async def _bucket(self, session, identity, offer, engines, attempt, index, bucket) -> None:  # type: ignore[no-untyped-def]
        body = {
            "names": [m.name for m in bucket],
            "dtypes": [m.dtype for m in bucket],
            "shapes": [m.shape for m in bucket],
            "group_name": self.group_name,
            "weight_version": str(offer.version),
            "flush_cache": index == len(offer.buckets) - 1,
        }
        calls = [self._post(session, e, "/update_weights_from_distributed", body) for e in engines]
        engine_calls = asyncio.ensure_future(self._gather(calls, engines))
        await self._command(identity, NcclCommand(
            action="broadcast", version=offer.version, attempt=attempt, bucket=index,
        ))  # fmt: skip
        ack_error = ""
        try:
            ack = await self._ack(offer.version, attempt, index)
            ack_error = "" if ack.ok else f"trainer failed to broadcast bucket {index}: {ack.error}"
        except TimeoutError:
            ack_error = f"no ack from the trainer for bucket {index} within {self.timeout_s:.0f}s"
        await engine_calls  # raises (naming the engines) if any engine failed
        if ack_error:
            raise RuntimeError(ack_error)

    async def _ack(self, version: int, attempt: int, index: int) -> NcclAck:
        """The trainer's ack of this bucket; late acks of abandoned attempts are skipped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            _identity, payload = await asyncio.wait_for(self.socket.recv_multipart(), remaining)
            try:
                ack = decode(payload, NcclAck)
            except ValueError:
                log.error("expected an ack from the trainer, got another message; ignored")
                continue
            if (ack.version, ack.attempt, ack.bucket) == (version, attempt, index):
                return ack
            log.warning("skipped a stale ack (%d/%d/%d)", ack.version, ack.attempt, ack.bucket)

    async def _pause(self, session, engine) -> None:  # type: ignore[no-untyped-def]
        if self.pause_mode != "none":
            await self._post(session, engine, "/pause_generation", {"mode": self.pause_mode})

    async def _continue(self, session, engine) -> None:  # type: ignore[no-untyped-def]
        if self.pause_mode != "none":
            await self._post(session, engine, "/continue_generation", {})

    # --- plumbing -------------------------------------------------------------------------------

    async def _each(self, session, engines, step, ignore_errors: bool = False) -> None:  # type: ignore[no-untyped-def]
        calls = [step(session, e) for e in engines]
        if ignore_errors:
            await asyncio.gather(*calls, return_exceptions=True)
        else:
            await self._gather(calls, engines)

    async def _gather(self, calls, engines: list[EngineState]) -> list:  # type: ignore[no-untyped-def]
        """Run one call per engine; engines whose call failed are taken out of rotation and
        a RuntimeError names them. Returns the results in engine order."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [
            (e, r) for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)
        ]
        for engine, error in failed:
            self.broker.mark_failed(engine, f"NCCL update failed: {error!r}")
        if failed:
            raise RuntimeError("; ".join(f"{e.url}: {r!r}" for e, r in failed))
        return results

    async def _post(self, session, engine: EngineState, path: str, body: dict) -> dict:  # type: ignore[no-untyped-def]
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with session.post(f"{engine.url}{path}", json=body, timeout=timeout) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 200 or (isinstance(reply, dict) and reply.get("success") is False):
                raise RuntimeError(f"{path} answered HTTP {resp.status}: {reply}")
            return reply if isinstance(reply, dict) else {}

    async def _get(self, session, url: str) -> dict:  # type: ignore[no-untyped-def]
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with session.get(url, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def _command(self, identity: bytes, command: NcclCommand) -> None:
        await self.socket.send_multipart([identity, encode(command)])
