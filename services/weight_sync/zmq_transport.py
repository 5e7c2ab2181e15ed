"""ZMQ endpoints of the weight path.

- `ZmqWeightSender` (trainer): PUSH-connects to the broker's intake and sends every bucket of a
  version. The socket's high-water mark bounds what queues in memory if the broker is slow;
  a send that cannot complete within `timeout_s` raises instead of blocking the trainer forever.
- `fetch_weights` (engine): DEALER-connects to the broker's serve endpoint, asks for a version
  (`WeightRequest`) and receives its buckets, or an error frame if the broker does not hold it.
  Every receive has a deadline, and a broker that goes away mid-fetch (its connection closes:
  killed or restarted) ends the fetch at once with `BrokerGoneError`, so the engine's next
  weight command does not queue behind a wait for a reply that cannot come.

Wire format and authentication: `services.weight_sync.wire`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import zmq

from proto import WeightRequest, encode
from services.weight_sync.shm import (
    ShmSlots,
    SlotBusyError,
    SlotLease,
    SlotSpaceError,
    read_slot,
)
from services.weight_sync.wire import (
    DEFAULT_BUCKET_BYTES,
    Frame,
    WeightSyncError,
    bucket_tensors,
    frame_view,
    make_buckets,
    parse_bucket,
    sign,
)

if TYPE_CHECKING:
    import torch

ERROR_FRAME = b"ERR"
log = logging.getLogger("tandem.weight_sync")


class BrokerGoneError(ConnectionError):
    """The broker's connection closed while a fetch waited for it."""


# Buckets queued per socket before send blocks: a couple of versions of a small model, or a few
# 512 MiB buckets of a large one. Beyond it the trainer waits (bounded by timeout_s).
SEND_HWM = 64


class ZmqWeightSender:
    """Trainer side of the trainer -> broker hop.

    With `shm_dir` (trainer, broker and engines on one host), each version is written once
    into a double-buffered slot file there (`services.weight_sync.shm`) and only its header
    travels over ZMQ. Writing version N+2 waits (at most `timeout_s`) until engines left N.
    """

    def __init__(
        self,
        endpoint: str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        secret: bytes | None = None,
        timeout_s: float = 120.0,
        shm_dir: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.slots = ShmSlots(shm_dir, timeout_s=timeout_s) if shm_dir else None
        self.bucket_bytes = bucket_bytes
        self.secret = secret
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(endpoint)

    def send(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send one version; returns the tensor bytes sent."""
        total = 0
        deadline = time.monotonic() + self.timeout_s
        if self.slots is not None:
            tensors = list(named_tensors)
            total = sum(t.numel() * t.element_size() for _, t in tensors)
            try:
                header = self.slots.write(version, tensors)
            except SlotBusyError as exc:
                raise WeightSyncError(f"version {version} not sent: {exc}") from exc
            except SlotSpaceError as exc:  # the versions go in ZMQ frames from now on
                log.warning("%s: weights go to the broker in ZMQ frames from now on", exc)
                self.slots.close()
                self.slots = None
                return self.send(version, tensors)
            sign(header, [], self.secret)
            messages = [[encode(header)]]
        else:
            messages = make_buckets(named_tensors, version, self.bucket_bytes, self.secret)
        for message in messages:
            while not self._socket.poll(100, zmq.POLLOUT):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"weight broker at {self.endpoint} accepted no data for "
                        f"{self.timeout_s:.0f}s (is `tandem broker` running there?)"
                    )
            self._socket.send_multipart(message, copy=False)
            if self.slots is None:
                total += sum(frame_view(f).nbytes for f in message[1:])
        return total

    def close(self, linger_s: float = 15.0) -> None:
        """Close the socket; shared-memory slots are removed once an engine took the newest
        version, or after `linger_s` (the last version still reaches the engines)."""
        self._socket.close()
        if self.slots is not None:
            self.slots.close(linger_s=linger_s)


class FetchedWeights(list):  # type: ignore[type-arg]
    """`[(hf_name, tensor)]` from `fetch_weights`. For a shared-memory version, `lease` holds
    the slot: keep it while the tensors are in use (or adopted as storage), then release it."""

    lease: SlotLease | None = None


def fetch_weights(
    endpoint: str, version: int, secret: bytes | None = None, timeout_s: float = 60.0
) -> FetchedWeights:
    """Every tensor of `version` from the broker at `endpoint`, in the order it was sent.

    Raises `TimeoutError` if the broker goes quiet for `timeout_s`, `LookupError` if it does not
    hold that version, `ValueError`/`AuthenticationError` on a bad bucket.
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    # a DEALER with no peer blocks its send forever: a broker that is not there is a timeout
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    try:
        try:
            sock.send(encode(WeightRequest(version=version)))
        except zmq.Again as exc:
            raise TimeoutError(
                f"weight broker at {endpoint} did not accept a connection within {timeout_s:g}s"
            ) from exc
        tensors = FetchedWeights()
        expected: int | None = None
        received = 0
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while expected is None or received < expected:
            ready = dict(poller.poll(int(timeout_s * 1000)))
            if sock not in ready and monitor in ready:
                raise BrokerGoneError(
                    f"weight broker at {endpoint} closed the connection while sending version "
                    f"{version} (it stopped or restarted: ask the new one)"
                )
            if sock not in ready:
                raise TimeoutError(
                    f"weight broker at {endpoint} sent nothing for {timeout_s:g}s "
                    f"while fetching version {version}"
                )
            message: list[Frame] = sock.recv_multipart(copy=False)
            if bytes(frame_view(message[0])) == ERROR_FRAME:
                raise LookupError(bytes(frame_view(message[1])).decode(errors="replace"))
            header, frames = parse_bucket(message, secret)
            if header.version != version:
                raise ValueError(f"asked for weight version {version}, got {header.version}")
            expected = header.num_buckets
            received += 1
            if header.shm_path:
                views, tensors.lease = read_slot(header, timeout_s)
                tensors.extend(views)
            else:
                tensors.extend(bucket_tensors(header, frames))
        return tensors
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
