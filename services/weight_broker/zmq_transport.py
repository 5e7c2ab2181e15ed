"""ZMQ endpoints of the weight path.

- `ZmqWeightSender` (trainer): PUSH-connects to the broker's intake and sends every bucket of a
  version. The socket's high-water mark bounds what queues in memory if the broker is slow;
  a send that cannot complete within `timeout_s` raises instead of blocking the trainer forever.
- `fetch_weights` (engine): DEALER-connects to the broker's serve endpoint, asks for a version
  (`WeightRequest`) and receives its buckets, or an error frame if the broker does not hold it.
  Every receive has a deadline.

Wire format and authentication: `services.weight_broker.wire`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import zmq

from proto import WeightRequest, encode
from services.weight_broker.wire import (
    DEFAULT_BUCKET_BYTES,
    Frame,
    bucket_tensors,
    frame_view,
    make_buckets,
    parse_bucket,
    write_shm_version,
)

if TYPE_CHECKING:
    import torch

ERROR_FRAME = b"ERR"
# Buckets queued per socket before send blocks: a couple of versions of a small model, or a few
# 512 MiB buckets of a large one. Beyond it the trainer waits (bounded by timeout_s).
SEND_HWM = 64


class ZmqWeightSender:
    """Trainer side of the trainer -> broker hop.

    With `shm_dir` (trainer, broker and engines on one host), each version is written once
    into a file there and only headers travel over ZMQ; the files of the `keep_shm` newest
    versions are kept (an engine may still be reading the previous one), older ones unlinked.
    """

    def __init__(
        self,
        endpoint: str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        secret: bytes | None = None,
        timeout_s: float = 120.0,
        shm_dir: str | None = None,
        keep_shm: int = 2,
    ) -> None:
        self.endpoint = endpoint
        self.shm_dir = shm_dir
        self.keep_shm = keep_shm
        self._shm_files: list[str] = []
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
        if self.shm_dir:
            tensors = list(named_tensors)
            total = sum(t.numel() * t.element_size() for _, t in tensors)
            path = os.path.join(self.shm_dir, f"tandem-weights-{os.getpid()}-{id(self)}-v{version}")
            messages = write_shm_version(tensors, version, path, self.secret)
            self._shm_files.append(path)
            while len(self._shm_files) > self.keep_shm:
                _unlink(self._shm_files.pop(0))
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
            if not self.shm_dir:
                total += sum(frame_view(f).nbytes for f in message[1:])
        return total

    def close(self) -> None:
        self._socket.close()
        for path in self._shm_files:
            _unlink(path)
        self._shm_files.clear()


def _unlink(path: str) -> None:
    """Remove a version file; engines that mapped it keep their (private) mapping."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fetch_weights(
    endpoint: str, version: int, secret: bytes | None = None, timeout_s: float = 60.0
) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of `version` from the broker at `endpoint`, in the order it was sent.

    Raises `TimeoutError` if the broker goes quiet for `timeout_s`, `LookupError` if it does not
    hold that version, `ValueError`/`AuthenticationError` on a bad bucket.
    """
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(endpoint)
    try:
        sock.send(encode(WeightRequest(version=version)))
        tensors: list[tuple[str, torch.Tensor]] = []
        expected: int | None = None
        received = 0
        while expected is None or received < expected:
            try:
                message: list[Frame] = sock.recv_multipart(copy=False)
            except zmq.Again as exc:
                raise TimeoutError(
                    f"weight broker at {endpoint} sent nothing for {timeout_s:.0f}s "
                    f"while fetching version {version}"
                ) from exc
            if bytes(frame_view(message[0])) == ERROR_FRAME:
                raise LookupError(bytes(frame_view(message[1])).decode(errors="replace"))
            header, frames = parse_bucket(message, secret)
            if header.version != version:
                raise ValueError(f"asked for weight version {version}, got {header.version}")
            expected = header.num_buckets
            received += 1
            tensors.extend(bucket_tensors(header, frames))
        return tensors
    finally:
        sock.close()
