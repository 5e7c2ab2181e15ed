"""The broker's transport seam, `WeightTransport`, and the bucket transports (ZMQ, disk).

A transport answers the broker's loop and calls nothing back: `next_version(wake)` is the
version to bring engines to now (bucket transports: the newest complete one, within `POLL_S`
or at once when `wake` is set; NCCL: the trainer's next offer); `sync` brings engines to it,
one `Outcome` each; `refuse` delivers it to none; `forget` drops what it knew of an engine;
`serve` runs its socket loops. `ZmqTransport`: engines fetch versions from our ROUTER socket
(`/update_weights_from_zmq`). `DiskTransport`: each version becomes a Hugging Face directory
under `--disk-dir` that engines reload (`/update_weights_from_disk`, as SGLang does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp
import zmq
import zmq.asyncio
from pydantic import BaseModel

from proto import WeightRequest, decode
from proto import sglang as sg
from services.weight_broker.config import BrokerConfig
from services.weight_broker.store import Version, VersionStore
from services.weight_sync.safetensors_file import write_safetensors
from services.weight_sync.wire import AuthenticationError, Frame, parse_bucket, secret_from_env
from services.weight_sync.zmq_transport import ERROR_FRAME

log = logging.getLogger("tandem.broker")
POLL_S = 1.0  # bucket transports: engines whose retry came due are seen within this


@dataclass
class Outcome:
    """What one engine's sync came to: `error` '' means it acknowledged the version."""

    error: str = ""
    elapsed_s: float = 0.0
    nbytes: int = 0


class EngineAnswerError(RuntimeError):
    """An engine answered a request with an error (it is alive and reachable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class WeightTransport(Protocol):
    intake_endpoint: str  # where the trainer sends versions
    serve_endpoint: str  # where engines fetch them ('' when they do not)
    retry_backoff_s: float  # when a failed engine is tried again (NCCL: once registered again)
    keeps_versions: bool  # it can bring an engine to the latest version without the trainer
    last_rejected: str  # why the trainer's last bucket was dropped ('' once a version came)

    async def next_version(self, wake: asyncio.Event) -> int: ...

    async def sync(
        self, session: aiohttp.ClientSession, urls: list[str], version: int
    ) -> dict[str, Outcome]: ...

    async def refuse(self, version: int, why: str) -> None: ...

    async def serve(self) -> None: ...

    def forget(self, url: str) -> None: ...

    def stop(self) -> None: ...


def as_json(body: BaseModel) -> dict:
    """One of SGLang's request bodies (proto/sglang.py) as sent: the fields set, none null."""
    return body.model_dump(mode="json", exclude_unset=True, exclude_none=True)


async def post(session: aiohttp.ClientSession, url: str, body: BaseModel) -> None:
    """POST `body`; `EngineAnswerError` unless the engine answers 200 without `success:
    false`. The session's timeout (the broker's `sync_timeout_s`) bounds it."""
    async with session.post(url, json=as_json(body)) as resp:
        reply = await resp.json(content_type=None)
        if resp.status != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            raise EngineAnswerError(f"{url} answered HTTP {resp.status}: {reply}", resp.status)


class ZmqTransport:
    """Buckets in from the trainer (PULL, HMAC-checked, into `VersionStore`); engines fetch
    each version from our ROUTER socket."""

    retry_backoff_s = 5.0
    keeps_versions = True

    def __init__(self, keep_versions: int = 2) -> None:
        self.store = VersionStore(keep_versions)
        self.intake_endpoint = self.serve_endpoint = ""
        self._prepared = -1
        self._preparing = asyncio.Lock()  # engines synced on their own tasks prepare once
        self._wake: asyncio.Event | None = None
        self.last_rejected = ""

    def bind(self, config: BrokerConfig, counters: dict[str, int]) -> None:
        """Bind the intake (PULL) and serve (ROUTER) sockets; `serve()` reads them."""
        self.counters, self.secret = counters, secret_from_env()
        ctx = zmq.asyncio.Context.instance()
        self.intake = ctx.socket(zmq.PULL)
        self.intake.bind(config.endpoints.intake_endpoint)
        self.intake_endpoint = self.intake.getsockopt_string(zmq.LAST_ENDPOINT)
        self.fetch = ctx.socket(zmq.ROUTER)
        self.fetch.setsockopt(zmq.LINGER, 0)
        self.fetch.bind(config.endpoints.serve_endpoint)
        self.serve_endpoint = self.fetch.getsockopt_string(zmq.LAST_ENDPOINT)
        if config.endpoints.advertise_host and self.serve_endpoint.startswith("tcp://"):
            port = self.serve_endpoint.rsplit(":", 1)[1]
            self.serve_endpoint = f"tcp://{config.endpoints.advertise_host}:{port}"
        log.info("intake %s, serving %s", self.intake_endpoint, self.serve_endpoint)

    def stop(self) -> None:
        self.intake.close(linger=0)
        self.fetch.close()

    def forget(self, url: str) -> None:
        """Nothing kept per engine: a restarted engine fetches like any other."""

    async def next_version(self, wake: asyncio.Event) -> int:
        self._wake = wake
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=POLL_S)
        wake.clear()
        return self.store.latest

    async def sync(
        self, session: aiohttp.ClientSession, urls: list[str], version: int
    ) -> dict[str, Outcome]:
        entry = self.store.get(version)
        if not urls or entry is None:
            return {}
        async with self._preparing:  # once per version (the disk copy), before any engine
            if self._prepared != version:
                try:
                    await asyncio.to_thread(self.prepare, entry)
                except OSError as exc:  # e.g. a full disk: every engine waits for its retry
                    return {
                        url: Outcome(f"cannot prepare version {version}: {exc}") for url in urls
                    }
                self._prepared = version

        async def one(url: str) -> Outcome:
            start = time.monotonic()
            try:
                await self.update(session, url, version)
            except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
                return Outcome(f"update to version {version} failed: {exc!r}")
            return Outcome("", time.monotonic() - start, entry.nbytes)

        return dict(zip(urls, await asyncio.gather(*map(one, urls)), strict=True))

    async def refuse(self, version: int, why: str) -> None:
        self.store.discard(version)

    def prepare(self, version: Version) -> None:
        """Nothing to do: the store already holds the buckets the engines will fetch."""

    async def update(self, session: aiohttp.ClientSession, url: str, version: int) -> None:
        """Bring one engine to `version`; `EngineAnswerError` with its message if refused."""
        body = sg.UpdateWeightsFromZmqReqInput(
            endpoint=self.serve_endpoint, weight_version=version, flush_cache=True
        )
        await post(session, f"{url}/update_weights_from_zmq", body)

    # --- socket loops -------------------------------------------------------------------------

    async def serve(self) -> None:
        await asyncio.gather(self._intake_loop(), self._fetch_loop())

    async def _intake_loop(self) -> None:
        """Trainer -> broker: assemble buckets (the HMAC is checked off the event loop); wake
        the broker's loop when a version is complete."""
        while True:
            message = await self.intake.recv_multipart(copy=False)
            try:
                done = await asyncio.to_thread(self._add_bucket, message)
            except (ValueError, AuthenticationError, TypeError, IndexError) as exc:
                self.counters["buckets_rejected"] += 1
                self.last_rejected = str(exc)
                log.error("dropped a weight bucket: %s", exc)
                continue
            if done is not None:
                self.last_rejected = ""
                self.counters["versions_received"] += 1
                log.info("version %d complete (%.1f MB)", done.version, done.nbytes / 1e6)
                if self._wake is not None:
                    self._wake.set()

    def _add_bucket(self, message: list[Frame]) -> Version | None:
        header, _frames = parse_bucket(message, self.secret)
        return self.store.add_bucket(header, message)

    async def _fetch_loop(self) -> None:
        """Engine fetches: every bucket of the version asked for, or an error frame."""
        while True:
            identity, *parts = await self.fetch.recv_multipart()
            try:
                if len(parts) != 1:
                    raise ValueError(f"{len(parts)} payload frames, expected 1 WeightRequest")
                request = decode(parts[0], WeightRequest)
            except ValueError as exc:
                self.counters["frames_rejected"] += 1
                await self.fetch.send_multipart([identity, ERROR_FRAME, str(exc).encode()])
                continue
            entry = self.store.get(request.version)
            if entry is None:
                msg = (
                    f"broker holds no weight version {request.version} (latest {self.store.latest})"
                )
                await self.fetch.send_multipart([identity, ERROR_FRAME, msg.encode()])
                continue
            for message in entry.messages():
                await self.fetch.send_multipart([identity, *message], copy=False)


class DiskTransport(ZmqTransport):
    """Buckets in from the trainer; each version out as a HF directory engines reload."""

    def __init__(self, disk_dir: str, model_dir: str, keep_versions: int = 2) -> None:
        if not disk_dir:
            raise ValueError("--transport disk needs --disk-dir (a folder the engines can read)")
        if not model_dir or not (Path(model_dir) / "config.json").exists():
            raise ValueError(
                "--transport disk needs --model-dir, a HF directory with config.json whose "
                "tokenizer and config files are copied next to each version's weights"
            )
        super().__init__(keep_versions)
        self.root = Path(disk_dir)
        self.model_dir = Path(model_dir)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    def prepare(self, version: Version) -> None:
        target = self.version_dir(version.version)
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weight_files = (".safetensors", ".bin", ".pt")
        for item in self.model_dir.iterdir():
            if item.is_file() and not item.name.endswith((*weight_files, ".index.json")):
                shutil.copy2(item, tmp / item.name)
        write_safetensors(tmp / "model.safetensors", version.messages())
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # engines only ever see complete directories
        for old in self.root.glob("v*"):
            number = old.name[1:]
            if number.isdigit() and int(number) <= version.version - self.store.keep_versions:
                shutil.rmtree(old, ignore_errors=True)

    async def update(self, session: aiohttp.ClientSession, url: str, version: int) -> None:
        path = str(self.version_dir(version))
        body = sg.UpdateWeightFromDiskReqInput(model_path=path, weight_version=version)
        await post(session, f"{url}/update_weights_from_disk", body)
