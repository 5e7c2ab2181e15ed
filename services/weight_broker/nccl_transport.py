"""Broker side of the NCCL weight path: `NcclTransport` (a `WeightTransport`, transports.py)
drives the trainer's `NcclWeightSender` (services/weight_sync/nccl_sender.py) with proto's
`NcclCommand`s through the sequence stated in proto/sglang.py's docstring (group, pause,
transfer, continue; what a failure does).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from proto import NcclAck, NcclCommand, NcclOffer, TensorMeta, decode, encode
from proto import sglang as sg
from services.weight_broker.config import BrokerConfig
from services.weight_broker.transports import EngineAnswerError, Outcome, post
from services.weight_sync.safetensors_file import tensors_nbytes
from services.weight_sync.wire import AuthenticationError, check_offer, secret_from_env

log = logging.getLogger("tandem.broker.nccl")
# Tries per version: the first, plus one with a fresh group if an engine failed during it.
MAX_ATTEMPTS = 2
MEMBER_CHECK_S = 5.0  # how long a live engine may take to answer a check, a resume, a broadcast
Session = aiohttp.ClientSession
UpdateBody = sg.UpdateWeightsFromDistributedReqInput


class NcclTransport:
    """`next_version` waits for the trainer's offer; `sync` runs steps 1-4 for it."""

    serve_endpoint = ""  # engines receive by broadcast, they fetch nothing
    retry_backoff_s = math.inf  # a dead member would make every version wait for its timeout
    keeps_versions = False  # only the trainer holds a version: a restarted engine needs it resent
    last_rejected = ""  # an offer that fails its HMAC check is answered: the trainer says why

    def __init__(self, config: BrokerConfig, counters: dict[str, int]) -> None:
        self.counters, self.secret = counters, secret_from_env()
        self.pause_mode = config.sync.pause_mode
        self.load_format = config.sync.nccl_load_format  # flattened_bucket | per_tensor
        self.timeout_s = config.sync.sync_timeout_s
        self.group_timeout_s = self.timeout_s / 2  # the trainer's collectives (and engines')
        self.quick = min(MEMBER_CHECK_S, self.timeout_s)  # bound of a call any live engine answers
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(config.endpoints.intake_endpoint)
        self.intake_endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("NCCL control at %s", self.intake_endpoint)
        self.members: list[str] = []  # engine URLs of the current group, in rank order
        self.group_name = ""
        self._generation = itertools.count()
        self._offer: tuple[bytes, NcclOffer] | None = None  # the trainer's, not yet answered
        self._failed: dict[str, str] = {}  # engine URL -> why it failed this version
        self._took: list[str] = []  # engines that confirmed this version (not sent it again)
        # engine URL -> what of Tandem's extensions it takes (its server info's
        # `weight_update_<name>: true`): bucket_sizes, layout_id, group_timeout
        self._takes: dict[str, set[str]] = {}
        self._known_layout: dict[str, str] = {}  # engine URL -> the layout_id it last took

    def stop(self) -> None:
        self.socket.close()

    async def serve(self) -> None:
        """Nothing beside the loop: offers and acks are read by `next_version` and `sync`."""

    async def refuse(self, version: int, why: str) -> None:
        """Answer the trainer's offer with `abort` (its sender raises, naming `why`)."""
        assert self._offer is not None and self._offer[1].version == version
        (identity, _offer), self._offer = self._offer, None
        await self._command(identity, "abort", version, message=why)

    def forget(self, url: str) -> None:
        """A restarted engine left its group and lost the layouts it took: form a new one."""
        self.members = []
        self._known_layout.pop(url, None)

    async def next_version(self, wake: asyncio.Event) -> int:
        """The version of the trainer's next offer (every offer is answered by `sync`)."""
        while True:
            parts = await self.socket.recv_multipart()
            try:
                if len(parts) != 2:
                    raise ValueError(f"{len(parts)} frames, expected identity and payload")
                identity, payload = parts
                offer = decode(payload, NcclOffer)
            except ValueError as exc:  # e.g. a late ack of an aborted version, or garbage
                self.counters["frames_rejected"] += 1
                log.warning("ignored a message that is not a version offer: %s", exc)
                continue
            try:
                check_offer(offer, self.secret)
            except AuthenticationError as exc:  # answered, so a misconfigured trainer says why
                self.counters["frames_rejected"] += 1
                log.error("refused an offer: %s", exc)
                await self._command(identity, "abort", offer.version, message=str(exc))
                continue
            self._offer = (identity, offer)
            return offer.version

    async def sync(
        self, session: aiohttp.ClientSession, urls: list[str], version: int
    ) -> dict[str, Outcome]:
        """Bring `urls` to the offered `version` (proto/sglang.py); the trainer gets
        `done` or `abort` whatever happens, so it never waits past its timeout."""
        assert self._offer is not None and self._offer[1].version == version
        (identity, offer), self._offer = self._offer, None
        self._failed, self._took, start = {}, [], time.monotonic()
        error = "no engine to bring to it (all serve it already, or none is in rotation)"
        for attempt in range(MAX_ATTEMPTS):
            if not (engines := [u for u in urls if u not in self._failed and u not in self._took]):
                break
            try:
                self._took += await self._attempt(session, identity, offer, engines, attempt)
                break
            except Exception as exc:  # whatever broke, later versions are still coordinated
                error = str(exc) or repr(exc)
                unexpected = not isinstance(exc, RuntimeError | TimeoutError)
                log.error(
                    "version %d attempt %d failed: %s", version, attempt, error, exc_info=unexpected
                )
                self.members = []  # a fresh group, without engines that failed
        if engines := self._took:
            log.info("version %d on %d engines", version, len(engines))
            await self._command(identity, "done", version)
        else:  # the trainer leaves its group on `abort`: the next version forms one
            self.members = []
            await self._command(identity, "abort", version, message=error)
        elapsed_s = time.monotonic() - start
        nbytes = sum(tensors_nbytes(b) for b in offer.buckets)
        # Each engine's outcome as it took the version or failed; one that answered an error
        # when another hung keeps its version, unblamed.
        outcomes = {url: Outcome(error) for url, error in self._failed.items()}
        return outcomes | {url: Outcome("", elapsed_s, nbytes) for url in engines}

    async def _attempt(
        self, session: Session, identity: bytes, offer: NcclOffer, engines: list[str], attempt: int
    ) -> list[str]:
        """Steps 1-4 for `engines`; the engines that took the version (RuntimeError if none).
        The next version forms a fresh group unless every member took this one."""
        paused: list[str] = []
        marks = [time.monotonic()]
        try:
            if engines != self.members:
                await self._form_group(session, identity, offer, engines, attempt)
            else:
                checks = [
                    self._get(session, e, "/model_info", "before the broadcast") for e in engines
                ]
                await self._gather(checks, engines)
            marks.append(time.monotonic())
            if self.pause_mode != "none":  # all resumed below, also when one pause failed
                paused = [e for e in engines if not self._applies_with_abort(e)]
                pause = sg.PauseGenerationReqInput.model_validate({"mode": self.pause_mode})
                calls = [post(session, f"{e}/pause_generation", pause) for e in paused]
                await self._gather(calls, paused)
            marks.append(time.monotonic())
            took = await self._transfer(session, identity, offer, engines, attempt)
            marks.append(time.monotonic())
        finally:  # engines that failed are out of rotation; resume the others
            resume = sg.ContinueGenerationReqInput()
            calls = [post(session, f"{e}/continue_generation", resume) for e in paused]
            with contextlib.suppress(TimeoutError):  # (one stopped: its next sync resumes it)
                await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), self.quick)
        marks.append(time.monotonic())
        steps = zip(("group", "pause", "transfer", "continue"), marks, marks[1:], strict=False)
        phases = ", ".join(f"{name} {1e3 * (b - a):.1f} ms" for name, a, b in steps)
        log.info("version %d phases: %s", offer.version, phases)
        if took != engines:
            self.members = []
        if not took:
            raise RuntimeError("no engine took it: " + "; ".join(self._failed.values()))
        return took

    # --- steps ----------------------------------------------------------------------------------

    async def _form_group(
        self, session: Session, identity: bytes, offer: NcclOffer, engines: list[str], attempt: int
    ) -> None:
        # Read at every new group: a restarted engine may be another build or configuration.
        infos = [self._get(session, e, "/get_server_info", "for a new group") for e in engines]
        tp_sizes = []
        for engine, info in zip(engines, await self._gather(infos, engines), strict=True):
            tp_sizes.append(int(info.get("tp_size", 1)))
            takes = (k for k, v in info.items() if k.startswith("weight_update_") and v is True)
            self._takes[engine] = {k.removeprefix("weight_update_") for k in takes}
            self._known_layout.pop(engine, None)
        world = 1 + sum(tp_sizes)
        self.group_name = f"tandem_weights_{next(self._generation)}"
        group = {"world_size": world, "group_name": self.group_name, "attempt": attempt}
        await self._command(
            identity, "init", offer.version, timeout_s=self.group_timeout_s, **group
        )
        offsets = zip(engines, itertools.accumulate([1, *tp_sizes]), strict=False)
        path = "/init_weights_update_group"
        calls = [post(session, e + path, self._init_body(offer, e, o, world)) for e, o in offsets]
        await self._gather(calls, engines)
        self.members = list(engines)

    async def _transfer(
        self, session: Session, identity: bytes, offer: NcclOffer, engines: list[str], attempt: int
    ) -> list[str]:
        """The engines that took the version. Each answer is the engine's own: once the
        trainer acked its broadcast, an engine that answered took the version whatever the
        others do. One with no answer `MEMBER_CHECK_S` after the ack (plus the broadcast's own
        time when it succeeded), stopped or slow, is left behind: no longer waited for, out of
        rotation (the router registers it again once it answers). RuntimeError when the
        broadcast failed: an engine that answered all the same has the version (`_took`: not
        sent it again); the retry forms a group of the others not blamed."""
        buckets = [b for b in offer.buckets if b] or [[]]

        @functools.cache  # built at most once per version, for the engines that take it
        def whole() -> UpdateBody:
            flat = self.load_format == "flattened_bucket"
            sizes = [len(b) for b in buckets if b] if flat else None
            return self._update_body(offer, [m for b in buckets for m in b], bucket_sizes=sizes)

        calls = [
            asyncio.ensure_future(
                self._post_version(session, e, offer, whole)
                if "bucket_sizes" in self._takes.get(e, ())
                else self._post_chain(session, e, offer, buckets)
            )
            for e in engines
        ]
        started = time.monotonic()
        await self._command(
            identity, "broadcast", offer.version, attempt=attempt, load_format=self.load_format
        )
        try:
            ack = await self._ack(offer.version, attempt)
            ack_error = "" if ack.ok else f"trainer failed to broadcast: {ack.error}"
        except TimeoutError:
            ack_error = f"no ack from the trainer within {self.timeout_s:.0f}s"
        # A failed broadcast fails every live member at once; a good one may take a live engine
        # about as long again to apply.
        grace = min(self.quick + (0.0 if ack_error else time.monotonic() - started), self.timeout_s)
        _done, late = await asyncio.wait(calls, timeout=grace)
        for call in late:
            call.cancel()
        left = f"left behind: no answer within {grace:.1f}s of the broadcast (stopped or slow)"
        results = [TimeoutError(left) if c in late else c.exception() for c in calls]
        self._blame(engines, results, whole_group=bool(ack_error))
        took = [e for e, r in zip(engines, results, strict=True) if r is None]
        if ack_error:  # one that answered has the version all the same: not sent it again
            self._took += took
            raise RuntimeError(ack_error + (f" (taken by {', '.join(took)})" if took else ""))
        return took

    def _init_body(
        self, offer: NcclOffer, engine: str, rank_offset: int, world_size: int
    ) -> sg.InitWeightsUpdateGroupReqInput:
        """An engine that takes it gets the trainer's group timeout: when a member dies mid-
        broadcast, the others give up with the trainer and answer an error before this broker's
        request timeout, so they are not blamed (with their own, longer one, they were)."""
        timeout = self.group_timeout_s if "group_timeout" in self._takes.get(engine, ()) else None
        return sg.InitWeightsUpdateGroupReqInput(
            master_address=offer.master_address,
            master_port=offer.master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=self.group_name,
            backend=offer.backend,
            timeout_s=timeout,
        )

    def _update_body(
        self, offer: NcclOffer, tensors: list[TensorMeta] | None, flush: bool = True, **extra: Any
    ) -> UpdateBody:
        """`tensors` None: named by the `layout_id` in `extra`. per_tensor is SGLang's default
        `load_format`: then the field is left out."""
        flat = "flattened_bucket" if self.load_format == "flattened_bucket" else None
        if tensors is not None:
            extra |= {"names": [m.name for m in tensors], "dtypes": [m.dtype for m in tensors]}
            extra["shapes"] = [m.shape for m in tensors]
        return sg.UpdateWeightsFromDistributedReqInput(
            group_name=self.group_name,
            weight_version=offer.version,
            flush_cache=flush,
            load_format=flat,
            **extra,
        )

    def _applies_with_abort(self, engine: str) -> bool:
        """Whether this engine's version update replaces the pause (step 2 of the sequence)."""
        return self.pause_mode == "abort" and "bucket_sizes" in self._takes.get(engine, ())

    async def _post_version(
        self, session: Session, engine: str, offer: NcclOffer, whole: Callable[[], UpdateBody]
    ) -> None:
        """The whole version in one request (engines that take `bucket_sizes`); `whole()`
        makes its body. An engine that took this layout before gets its `layout_id` instead
        of thousands of names; if it no longer knows the id (409, answered before any
        collective), the full request."""
        extra = {"abort_all_requests": True} if self._applies_with_abort(engine) else {}
        path, layout_id = "/update_weights_from_distributed", offer.layout_id
        if not (layout_id and "layout_id" in self._takes.get(engine, ())):
            await post(session, engine + path, whole().model_copy(update=extra))
            return
        if self._known_layout.get(engine) == layout_id:
            short = self._update_body(offer, None, layout_id=layout_id, **extra)
            try:
                await post(session, engine + path, short)
                return
            except EngineAnswerError as exc:
                if exc.status != 409 or "layout_id" not in str(exc):  # not a version refusal
                    raise
                log.info("%s no longer knows layout %s: sending it in full", engine, layout_id)
        self._known_layout.pop(engine, None)
        full = whole().model_copy(update={**extra, "layout_id": layout_id})
        await post(session, engine + path, full)
        self._known_layout[engine] = layout_id

    async def _post_chain(
        self, session: Session, engine: str, offer: NcclOffer, buckets: list[list[TensorMeta]]
    ) -> None:
        """One request per bucket, each after the previous one answered (SGLang); the whole
        chain within `sync_timeout_s`, not each request."""

        async def chain() -> None:
            for index, bucket in enumerate(buckets):
                body = self._update_body(offer, bucket, flush=index == len(buckets) - 1)
                await post(session, f"{engine}/update_weights_from_distributed", body)

        try:
            await asyncio.wait_for(chain(), self.timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{len(buckets)} bucket requests took longer than {self.timeout_s:.0f}s"
            ) from exc

    async def _ack(self, version: int, attempt: int) -> NcclAck:
        """The trainer's ack of this broadcast; late acks of abandoned attempts are skipped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            parts = await asyncio.wait_for(self.socket.recv_multipart(), remaining)
            try:
                ack = decode(parts[-1], NcclAck)
            except ValueError:
                self.counters["frames_rejected"] += 1
                log.error("expected an ack from the trainer, got another message; ignored")
                continue
            if (ack.version, ack.attempt, ack.bucket) == (version, attempt, -1):
                return ack
            log.warning("skipped a stale ack (%d/%d/%d)", ack.version, ack.attempt, ack.bucket)

    # --- plumbing -------------------------------------------------------------------------------

    async def _gather(self, calls: Sequence[Awaitable[Any]], engines: list[str]) -> list[Any]:
        """Run one call per engine; engines whose call failed are taken out of rotation and
        a RuntimeError names them. Returns the results in engine order."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        if failed := self._blame(engines, results, whole_group=True):
            raise RuntimeError("; ".join(f"{e}: {r!r}" for e, r in failed))
        return results

    def _blame(
        self, engines: list[str], results: Sequence[Any], whole_group: bool
    ) -> list[tuple[str, BaseException]]:
        """The engines whose call failed, each put in `_failed` unless `whole_group` (a step
        of the group failed for every member) and it answered: a collective breaks for every
        member when one hangs or dies, and the others answer an error ("broadcast failed,
        weights unchanged"); they stay in rotation for the retry with a fresh group."""
        failed = [
            (e, r) for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)
        ]
        silent = [(e, r) for e, r in failed if not isinstance(r, EngineAnswerError)]
        for engine, error in silent if whole_group and silent else failed:
            self._failed[engine] = f"NCCL update failed: {error!r}"
        return failed

    async def _get(self, session: Session, engine: str, path: str, when: str) -> Any:
        """`GET path`'s JSON within `quick`, ConnectionError naming `when` otherwise: an engine
        stopped or dead since it registered must not hold a step for the sync timeout. Before a
        broadcast every member is asked `/model_info`: one that died since the group formed
        would hold the others in the collective until its timeout; it is out of rotation, and
        the retry forms a group without it (seen on 4 H200s: an engine killed between
        versions)."""
        try:
            async with session.get(engine + path, timeout=aiohttp.ClientTimeout(self.quick)) as r:
                r.raise_for_status()
                return await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ConnectionError(
                f"did not answer GET {path} {when} (within {self.quick:g}s): {exc!r}"
            ) from exc

    async def _command(self, identity: bytes, action: str, version: int, **fields: Any) -> None:
        command = NcclCommand(action=action, version=version, **fields)
        await self.socket.send_multipart([identity, encode(command)])
