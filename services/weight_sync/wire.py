"""Weight buckets on the wire: a msgpack `WeightBucketHeader` frame, then one raw frame per tensor.

Used on both ZMQ hops: trainer -> broker (PUSH/PULL) and broker -> engine (DEALER/ROUTER).
Tensors travel as their raw little-endian bytes, Hugging Face names in the header; no pickle.

Authentication: with a shared secret (env `TANDEM_WEIGHT_SECRET`), each header carries an
HMAC-SHA256 over the header (with an empty `mac`) and every tensor frame. A receiver holding the
secret rejects a bucket whose MAC is missing or wrong (`AuthenticationError`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from proto import NcclOffer, TensorMeta, WeightBucketHeader, decode, encode
from services.common.auth import is_loopback

if TYPE_CHECKING:
    import torch

SECRET_ENV = "TANDEM_WEIGHT_SECRET"
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

Frame = Any  # bytes, memoryview or zmq.Frame: anything exposing the buffer protocol


class WeightSyncError(RuntimeError):
    """A version did not reach the engines (they keep the previous one); training goes on."""


class AuthenticationError(ValueError):
    """A bucket's MAC did not verify: it was not sent by a holder of the shared secret."""


def secret_from_env() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def check_weight_bind(flag: str, address: str) -> None:
    """Weight traffic from outside loopback must be signed: ValueError naming `flag` and
    TANDEM_WEIGHT_SECRET when `address` (a host, or a tcp:// endpoint) is reachable from other
    machines and no secret is set."""
    if secret_from_env() is not None or not address:
        return
    if address.startswith(("ipc://", "inproc://")):
        return
    host = address.removeprefix("tcp://").rsplit(":", 1)[0] if "://" in address else address
    if not is_loopback(host):
        raise ValueError(
            f"{flag} {address} accepts weight traffic from other machines, but {SECRET_ENV} is "
            f"not set: set {SECRET_ENV} (the same value for trainer, broker and engines; "
            "`tandem up` generates one), or use 127.0.0.1"
        )


def frame_view(frame: Frame) -> memoryview:
    """Byte view of a frame, whether bytes, memoryview or a `zmq.Frame`."""
    buffer: Any = frame.buffer if hasattr(frame, "buffer") else frame
    return memoryview(buffer)


def sign(header: WeightBucketHeader, frames: Sequence[Frame], secret: bytes | None) -> None:
    """Set `header.mac` (no-op without a secret)."""
    if secret:
        header.mac = _mac(secret, header, frames)


def _mac(secret: bytes, header: WeightBucketHeader, frames: Sequence[Frame]) -> bytes:
    unsigned = WeightBucketHeader(
        version=header.version,
        bucket_index=header.bucket_index,
        num_buckets=header.num_buckets,
        tensors=header.tensors,
        shm_path=header.shm_path,
        shm_offsets=header.shm_offsets,
    )
    digest = hmac.new(secret, encode(unsigned), hashlib.sha256)
    for frame in frames:
        digest.update(frame_view(frame))
    return digest.digest()


def offer_mac(offer: NcclOffer, secret: bytes | None) -> bytes:
    """The MAC of an NCCL offer (b"" without a secret): it names the rendezvous the engines will
    join, so an unsigned one must not reach them."""
    if not secret:
        return b""
    return hmac.new(secret, encode(msgspec.structs.replace(offer, mac=b"")), "sha256").digest()


def check_offer(offer: NcclOffer, secret: bytes | None) -> None:
    """`AuthenticationError` unless the offer's MAC matches (anything passes without a secret)."""
    if secret and not hmac.compare_digest(offer.mac, offer_mac(offer, secret)):
        raise AuthenticationError(
            f"weight version {offer.version} offer is unsigned or fails its HMAC check "
            f"(is {SECRET_ENV} the same for trainer and broker?)"
        )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(__import__("torch").uint8).numpy())


def group_by_bytes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, ramp: bool = False
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `bucket_bytes` (a larger tensor gets a group of its own).
    With `ramp`, the first three groups hold at most 1/8, 1/4 and 1/2 of `bucket_bytes`."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    limits = [bucket_bytes // 8, bucket_bytes // 4, bucket_bytes // 2] if ramp else []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.nbytes
        limit = limits[len(groups) - 1] if len(groups) <= len(limits) else bucket_bytes
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    return groups


def make_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    secret: bytes | None = None,
) -> list[list[Frame]]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor gets its own) and
    return each bucket as a ZMQ multipart message `[header, frame, frame, ...]`."""
    groups = group_by_bytes(((n, t.detach().cpu()) for n, t in named_tensors), bucket_bytes)
    messages = []
    for index, group in enumerate(groups):
        frames = [tensor_bytes(t) for _, t in group]
        header = WeightBucketHeader(
            version=version,
            bucket_index=index,
            num_buckets=len(groups),
            tensors=[
                TensorMeta(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                for name, t in group
            ],
        )
        if secret:
            header.mac = _mac(secret, header, frames)
        messages.append([encode(header), *frames])
    return messages


def parse_bucket(
    message: Sequence[Frame], secret: bytes | None = None
) -> tuple[WeightBucketHeader, list[Frame]]:
    """Split and check one multipart bucket. Raises `ValueError` on a malformed bucket and
    `AuthenticationError` on a bad MAC."""
    if not message:
        raise ValueError("empty weight bucket")
    raw_header = message[0]
    header = decode(bytes(frame_view(raw_header)), WeightBucketHeader)
    frames = list(message[1:])
    if header.shm_path:
        if frames or len(header.shm_offsets) != len(header.tensors):
            raise ValueError(
                f"shared-memory bucket {header.bucket_index} of version {header.version} must "
                "carry no frames and one offset per tensor"
            )
    elif len(frames) != len(header.tensors):
        raise ValueError(
            f"weight bucket {header.bucket_index} of version {header.version} names "
            f"{len(header.tensors)} tensors but carries {len(frames)} frames"
        )
    if secret is not None and not (
        header.mac and hmac.compare_digest(header.mac, _mac(secret, header, frames))
    ):
        raise AuthenticationError(
            f"weight bucket {header.bucket_index} of version {header.version} failed its "
            f"HMAC check (is {SECRET_ENV} the same for trainer, broker and engines?)"
        )
    return header, frames


def bucket_tensors(
    header: WeightBucketHeader, frames: Sequence[Frame]
) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a frames bucket. They share memory with the frames (no copy), read-only:
    the receiver copies them into its weights. (A shared-memory bucket is read with
    `services.weight_sync.shm.read_slot`.)"""
    import torch

    # torch warns (once a process, on the console) that a tensor over a read-only frame could
    # write to it; these are only ever read.
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
    out = []
    for meta, frame in zip(header.tensors, frames, strict=True):
        dtype = getattr(torch, meta.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {meta.name!r} has unknown dtype {meta.dtype!r}")
        buffer = frame_view(frame)
        if buffer.nbytes == 0:
            tensor = torch.empty(meta.shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(buffer, dtype=dtype).reshape(meta.shape)
        out.append((meta.name, tensor))
    return out
